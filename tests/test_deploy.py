"""fastmamba.serve.deploy on a local Ray cluster (CPU, the bundled model): replicas behind the
OpenAI routes, requests routed by prefix, a replica killed. Bounded request loops."""

from __future__ import annotations

import importlib.util
import json
import socket
import subprocess
import sys
import time

import pytest

import fastmamba

if importlib.util.find_spec("ray") is None:  # (not imported here: the app fixture starts Ray as serve does, first)
    pytest.skip("needs ray[serve]", allow_module_level=True)
openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def app():
    from fastmamba.serve.main import start_ray

    start_ray("127.0.0.1", num_cpus=4)  # (on loopback where this is Ray's first import: see the test below)
    import ray
    from ray import serve

    from fastmamba.serve.deploy import build
    from fastmamba.serve.options import ServeOptions

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    options = ServeOptions.from_dict(dict(replicas=2, max_batch=4, served_model_name="tiny"))
    serve.run(build(options), name="fastmamba", route_prefix="/")
    yield openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=120)
    serve.shutdown()
    ray.shutdown()


@pytest.fixture(scope="module")
def lm():
    return fastmamba.load()


def test_replicas_answer_what_generate_gives_alone(app, lm):
    for seed in range(4):
        out = app.completions.create(model="tiny", prompt="To be, or not", max_tokens=12, temperature=0.8, seed=seed)
        assert out.choices[0].text == lm.generate("To be, or not", max_tokens=12, temperature=0.8, seed=seed).text
    streamed = app.completions.create(model="tiny", prompt="ROMEO.", max_tokens=10, seed=3, temperature=0.7, stream=True)
    assert "".join(ch.choices[0].text for ch in streamed if ch.choices) == lm.generate(
        "ROMEO.", max_tokens=10, seed=3, temperature=0.7).text


def test_replicas_answer_several_choices_and_prompts_of_one_request(app, lm):
    """n > 1 and a list of prompts, whose choices may go to different replicas at once: each
    what generate gives it alone (choice k with seed + k), streamed and not (such a request
    hung: its calls shared the HTTP request's ids in Ray's router)."""
    c = app.with_options(timeout=60)
    out = c.completions.create(model="tiny", prompt="To be, or not", max_tokens=6, temperature=0.8, seed=5, n=2)
    assert [ch.text for ch in out.choices] == [
        lm.generate("To be, or not", max_tokens=6, temperature=0.8, seed=5 + k).text for k in range(2)]
    prompts = ["x", "y", "z", "w", "To be"]  # (keys that reach both replicas)
    listed = c.completions.create(model="tiny", prompt=prompts, max_tokens=4, temperature=0)
    assert [ch.text for ch in listed.choices] == [lm.generate(p, max_tokens=4).text for p in prompts]
    streamed = c.completions.create(model="tiny", prompt=prompts, max_tokens=4, temperature=0, stream=True)
    texts = [""] * len(prompts)
    for chunk in streamed:
        for ch in chunk.choices:
            texts[ch.index] += ch.text
    assert texts == [ch.text for ch in listed.choices]


def test_a_conversations_turns_return_to_their_replica(app, lm):
    """Each turn repeats the conversation's opening, its routing key: turn 2 lands where turn
    1 ran and resumes from the state it left (on another replica it would prefill all)."""
    newline = lm.encode("\n")
    for k in range(4):  # four conversations: whichever replica each hashes to
        msgs = [{"role": "user", "content": f"Speak, good sir, of thing {k}."}]
        first = app.chat.completions.create(model="tiny", messages=msgs, max_tokens=30, temperature=0,
                                            extra_body={"stop_token_ids": newline})
        msgs += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "More."}]
        second = app.chat.completions.create(model="tiny", messages=msgs, max_tokens=4, temperature=0)
        cached = second.usage.prompt_tokens_details.cached_tokens
        assert cached >= first.usage.prompt_tokens + first.usage.completion_tokens, k
    # the front end's metrics count the replicas' prefix-cache hits
    import urllib.request

    text = urllib.request.urlopen(str(app.base_url).removesuffix("v1/") + "metrics", timeout=30).read().decode()
    hits = next(float(line.split()[1]) for line in text.splitlines() if line.startswith("fastmamba:prefix_cache_hits_total"))
    assert hits >= 4


def test_a_killed_replica_leaves_the_app_serving(app):
    import ray

    actors = [a for a in ray.util.list_named_actors(all_namespaces=True) if "EngineReplica" in a["name"]]
    assert len(actors) == 2
    ray.kill(ray.get_actor(actors[0]["name"], namespace=actors[0]["namespace"]), no_restart=True)
    ok, deadline = 0, time.time() + 90
    while ok < 6 and time.time() < deadline:  # the other replica serves; Ray starts a new one
        try:
            out = app.completions.create(model="tiny", prompt=f"Act {ok}.", max_tokens=3)
            ok += len(out.choices) == 1
        except openai.APIStatusError as e:  # a request routed to the dead one: a 503, not a hang
            assert e.status_code == 503
            time.sleep(0.5)
    assert ok == 6


def test_batch_over_a_dataset_equals_generate_batch(app, lm):
    """200 prompts on two actors, in blocks of 32: each row what generate_batch (and so
    generate alone) gives it with the row's seed, its own column where the dataset has one."""
    import ray

    import fastmamba
    from fastmamba.serve.deploy import prompt_seed

    prompts = [f"Act {k}. Scene {k % 7}." for k in range(200)]
    params = dict(max_tokens=5, temperature=0.8)
    rows = fastmamba.batch(ray.data.from_items([{"prompt": p} for p in prompts]), concurrency=2, batch_size=32,
                           **params).take_all()
    assert len(rows) == 200
    by_prompt = {r["prompt"]: r for r in rows}
    seeds = [prompt_seed(p, 0) for p in prompts]
    want = lm.generate_batch(prompts, [fastmamba.SamplingParams(seed=s, **params) for s in seeds])
    for p, s, w in zip(prompts, seeds, want):
        row = by_prompt[p]
        assert row["seed"] == s and row["text"] == w.text and list(row["token_ids"]) == w.token_ids
    # a seed column is each row's seed; a row without one takes its prompt's (it failed on the gap's NaN)
    given = fastmamba.batch(ray.data.from_items([{"prompt": "To be", "seed": 7}, {"prompt": "Or not", "seed": None}]),
                            **params).take_all()
    by_prompt = {r["prompt"]: r for r in given}
    assert by_prompt["To be"]["text"] == lm.generate("To be", seed=7, **params).text
    assert by_prompt["Or not"]["seed"] == prompt_seed("Or not", 0)


def test_the_command_lines_scale_settings(monkeypatch):
    from fastmamba.serve import deploy
    from fastmamba.serve.options import autoscaling

    built = []
    monkeypatch.setattr(deploy, "build", built.append)
    deploy.app({"model": "m", "replicas": "3", "max_batch": "8", "deterministic": "true", "stream_interval_ms": "20"})
    options = built.pop()
    assert options.replicas == 3 and options.engine.max_batch == 8 and options.engine.deterministic is True
    assert options.stream_interval_ms == 20.0 and options.engine.model == "m"
    deploy.app({"autoscale": "1:4", "max_batch": "8"})
    assert built.pop().autoscaling() == {"min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 8}
    for bad in ("4", "3:1", "a:b", "0:0"):
        with pytest.raises(ValueError, match="--autoscale"):
            autoscaling(bad)
        with pytest.raises(ValueError, match="--autoscale"):
            deploy.app({"autoscale": bad})
    with pytest.raises(ValueError, match="--max-batch"):
        deploy.app({"max_batch": "many"})


def test_a_routing_policy_is_prefix_or_round_robin():
    from fastmamba.serve.deploy import build
    from fastmamba.serve.options import ServeOptions

    with pytest.raises(ValueError, match="routing must be 'prefix' or 'round-robin'"):
        build(ServeOptions(replicas=1), routing="random")


def test_a_replica_sends_a_streams_tokens_in_lists_at_its_interval():
    """EngineReplica.generate without Ray: the first output alone and at once, then what
    came in each interval, every output once and in order, the end with the replica's stats."""
    import asyncio

    from fastmamba.engine import protocol
    from fastmamba.engine.protocol import Finished, Stats, Token
    from fastmamba.serve.deploy import EngineReplica, ReplicaOutputs

    class Engine:  # outputs every 5 ms, as the engine's steps would give them
        stats = Stats(running=1)
        aborted = []

        def submit(self, ids, params, top_logprobs, emit):
            async def feed():
                for k in range(30):
                    await asyncio.sleep(0.005)
                    emit(Token(0, k))
                emit(Finished(0, "length", 2, 30, 0, 0.0))
            self.task = asyncio.get_running_loop().create_task(feed())
            return 0

        def abort(self, rid):
            self.aborted.append(rid)

        def shutdown(self, timeout=10):
            pass

    replica = object.__new__(EngineReplica)
    replica.client, replica.name, replica.interval = Engine(), "r0", 0.04
    replica._encode = protocol.encoder().encode
    decode = protocol.decoder(ReplicaOutputs).decode

    async def run():
        t0, got = time.monotonic(), []
        async for item in replica.generate(1, [1, 2], None, None):
            got.append((time.monotonic() - t0, decode(item)))
        return got

    got = asyncio.run(run())
    assert len(got[0][1].outputs) == 1  # the first token goes on at once (waiting, it would have company)
    assert [o.token for _, b in got for o in b.outputs if isinstance(o, Token)] == list(range(30))
    assert 3 <= len(got) <= 12  # ~150 ms of tokens in lists 40 ms apart, not 30 messages
    assert all(b - a >= 0.02 for (a, _), (b, _) in zip(got[1:], got[2:]))
    last = got[-1][1]
    assert isinstance(last.outputs[-1], Finished) and last.replica == "r0" and last.stats == Stats(running=1)
    assert all(b.replica is None for _, b in got[:-1])
    assert replica.client.aborted == [0]  # (the request is let go once its stream ends)



# Run in a fresh interpreter (Ray's node address is settled when Ray is first imported):
# start Ray as `serve --replicas` does for a loopback --host, then print every TCP listener
# that this process or one of its descendants (the GCS, the raylet, the agents, the
# workers) holds, as (address in /proc/net's hex, port).
LISTENERS = """
import json, os
from fastmamba.serve.main import start_ray

start_ray("127.0.0.1", num_cpus=1)
import ray

def descendants(root):
    found, todo = {root}, [root]
    while todo:
        pid = todo.pop()
        for task in os.listdir(f"/proc/{pid}/task") if os.path.isdir(f"/proc/{pid}/task") else ():
            try:
                with open(f"/proc/{pid}/task/{task}/children") as f:
                    kids = {int(c) for c in f.read().split()} - found
            except OSError:
                continue
            found |= kids
            todo.extend(kids)
    return found

listening = {}
for table in ("tcp", "tcp6"):
    with open(f"/proc/net/{table}") as f:
        for line in list(f)[1:]:
            fields = line.split()
            if fields[3] == "0A":
                address, port = fields[1].split(":")
                listening[fields[9]] = (address, int(port, 16))
held = set()
for pid in descendants(os.getpid()):
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        continue
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:[") and target[8:-1] in listening:
            held.add(listening[target[8:-1]])
print(json.dumps(sorted(held)))
ray.shutdown()
"""
# 127.0.0.1, its IPv4-mapped IPv6 form and ::1 as /proc/net writes them
LOOPBACK_HEX = ("0100007F", "0000000000000000FFFF00000100007F", "00000000000000000000000001000000")


def test_ray_started_by_serve_listens_on_loopback_only():
    """`serve --replicas` with its default --host: none of Ray's services (the GCS, the
    raylet, the dashboard agent, the runtime env agent, the workers) listens on another
    interface (on Linux, Ray's own default puts several on every interface)."""
    r = subprocess.run([sys.executable, "-c", LISTENERS], capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    held = [tuple(x) for x in json.loads(r.stdout.strip().splitlines()[-1])]
    assert len(held) >= 4, held  # (Ray's services did start)
    assert all(address in LOOPBACK_HEX for address, _ in held), held
