"""The multi-GPU run of fastmamba.serve.deploy: Ray Serve replicas (one GPU each) behind the
OpenAI routes, on loopback, with bounded request loops. Four measurements:

1. throughput (output tokens/s) and time to first token (p50 / p99) with 1 replica and
   with N, at 64 x R and 256 x R streams (R replicas): 512-token prompts of random token
   ids, 256 tokens each, greedy;
2. a multi-turn chat (conversations x turns, all conversations at once, each turn after
   the last one's answer), prefix-aware routing against round robin: of turns 2 and
   later, the share that resumed from their conversation's cached state (usage's
   cached_tokens covers the last turn's prompt and answer: only the replica that ran it
   holds that state) and their time to first token;
3. one replica killed mid-run: every request ends complete or with a 503 (none lost or
   hung), and output tokens/s each second, to see it recover when Ray replaces the replica;
0. with --baseline, first the same throughput levels through plain `fastmamba serve` (one
   engine, no Ray; a subprocess on loopback), and Ray's overhead at 1 replica against it
   (the single-GPU measurement: `--replicas 1 --baseline --measures throughput`).

    python -m benchmarks.ray_serve --shape 2.8b --device cuda --dtype bfloat16 --replicas 2 --json ray.json
    python -m benchmarks.ray_serve --replicas 2 --streams 2 --prompt-tokens 32 --max-tokens 8 --chat 6x3  # CPU

--shape writes a checkpoint of random weights at a public shape (with the bundled model's
tokenizer) for the replicas to load; without it and without --model, the bundled model.
"""

import argparse
import asyncio
import itertools
import json
import random
import socket
import sys
import tempfile
import time
from pathlib import Path


def pct(values, q):
    values = sorted(v for v in values if v == v)
    return round(values[min(len(values) - 1, int(q * len(values)))], 4) if values else None


async def stream(client, url: str, route: str, body: dict, timeout: float):
    """One streaming request: dict(status, ttft, tokens, usage, times) (status -1: no answer)."""
    t0 = time.perf_counter()
    out = dict(status=-1, ttft=float("nan"), tokens=0, usage=None, times=[], text="")
    try:
        async with client.stream("POST", url + route, json={**body, "stream": True}, timeout=timeout) as r:
            out["status"] = r.status_code
            if r.status_code != 200:
                await r.aread()
                return out
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:  # (after the 200: a failure mid-stream, 503 where the replica went away)
                    code = chunk["error"].get("code")
                    out["status"] = 503 if code in ("server_shutting_down", "engine_unavailable") else 500
                    return out
                if chunk.get("usage"):
                    out["usage"] = chunk["usage"]
                choices = chunk.get("choices") or []
                if choices and choices[0].get("finish_reason") is None:
                    out["times"].append(time.perf_counter())
                    out["text"] += choices[0].get("text") or (choices[0].get("delta") or {}).get("content") or ""
            out["ttft"] = out["times"][0] - t0 if out["times"] else float("nan")
            out["tokens"] = len(out["times"])
    except Exception as e:  # a hung-up or timed-out stream: counted, not raised
        out["error"] = type(e).__name__
    return out


def client(concurrency: int):
    import httpx

    limits = httpx.Limits(max_connections=concurrency + 8, max_keepalive_connections=concurrency + 8)
    return httpx.AsyncClient(limits=limits)


async def completions(url: str, streams: int, requests: int, prompt_tokens: int, max_tokens: int, vocab: int,
                      seed: int, on_start=None):
    """`requests` streamed completions, `streams` at a time: (results, wall s)."""
    rng = random.Random(seed)
    jobs = [[rng.randrange(1, vocab) for _ in range(prompt_tokens)] for _ in range(requests)]
    sem = asyncio.Semaphore(streams)
    async with client(streams) as c:
        async def run(ids):
            async with sem:
                return await stream(c, url, "/v1/completions", dict(
                    prompt=ids, max_tokens=max_tokens, temperature=0, stop_token_ids=[]), 600)

        t0 = time.perf_counter()
        tasks = [asyncio.create_task(run(ids)) for ids in jobs]
        if on_start is not None:
            await on_start()
        results = await asyncio.gather(*tasks)
        return results, time.perf_counter() - t0


async def chat(url: str, conversations: int, turns: int, max_tokens: int):
    """Every conversation at once, each turn after the last one's answer (the answer's text
    as the assistant's message): per turn, (turn index, ttft, hit). hit: cached_tokens
    covers at least the last turn's prompt, whose end state only the replica that ran it
    holds (the engine caches every prompt's end; the answer's text may not encode back to
    the answer's very tokens, so the prompt is the measure)."""
    async with client(conversations) as c:
        async def talk(k):
            msgs, seen, rows = [], 0, []
            for turn in range(turns):
                msgs.append({"role": "user", "content": f"Conversation {k}, turn {turn}: say more of act {k % 5}."})
                r = await stream(c, url, "/v1/chat/completions", dict(
                    messages=msgs, max_tokens=max_tokens, temperature=0, stream_options={"include_usage": True}), 600)
                usage = r["usage"] or {}
                cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                rows.append(dict(turn=turn, ttft=r["ttft"], ok=r["status"] == 200, hit=turn > 0 and cached >= seen > 0))
                seen = usage.get("prompt_tokens", 0)
                msgs.append({"role": "assistant", "content": r["text"]})
            return rows

        return [row for rows in await asyncio.gather(*(talk(k) for k in range(conversations))) for row in rows]


def summary(results, wall: float) -> dict:
    ok = [r for r in results if r["status"] == 200 and r["tokens"] > 0]
    return dict(requests=len(results), ok=len(ok), status_503=sum(r["status"] == 503 for r in results),
                other=len(results) - len(ok) - sum(r["status"] == 503 for r in results),
                tokens_per_s=round(sum(r["tokens"] for r in ok) / wall, 1),
                ttft_p50_s=pct([r["ttft"] for r in ok], 0.5), ttft_p99_s=pct([r["ttft"] for r in ok], 0.99))


def start_app(args, folder: str, replicas: int, routing: str, port: int, interval: float | None = None) -> None:
    from ray import serve

    from fastmamba.serve.deploy import build
    from fastmamba.serve.options import ServeOptions

    interval = float(args.stream_intervals.split(",")[0]) if interval is None else interval
    options = ServeOptions.from_dict(dict(model=folder, replicas=replicas, device=args.device, dtype=args.dtype,
                                          max_batch=args.max_batch, served_model_name="m", stream_interval_ms=interval,
                                          prefix_cache_mb=args.prefix_cache_mb))
    serve.run(build(options, routing=routing), name="fastmamba", route_prefix="/")


def plain_server(args, folder: str, port: int):
    """`fastmamba serve` on the same checkpoint and settings, without Ray: the subprocess,
    once it answers /v1/models (at most 10 minutes: a large checkpoint loads and compiles)."""
    import subprocess
    import urllib.request

    flags = ["--model", folder, "--device", args.device, "--dtype", args.dtype, "--port", str(port),
             "--served-model-name", "m"] + (["--max-batch", str(args.max_batch)] if args.max_batch else [])
    proc = subprocess.Popen([sys.executable, "-m", "fastmamba.cli", "serve", *flags])
    for _ in range(1200):
        if proc.poll() is not None:
            raise SystemExit(f"fastmamba serve exited with {proc.returncode}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=1)
            return proc
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise SystemExit("fastmamba serve did not answer in 10 minutes")


def prefix_state_bytes(c) -> int:
    """One prefix cache entry's bytes (prefix_cache.CachedState): every layer's conv and ssm
    state in float32, and the logits."""
    from fastmamba.core.layers import state_bytes

    return state_bytes(c, 4) + 4 * c.vocab_size


def replica_actors() -> list:
    import ray

    return [a for a in ray.util.list_named_actors(all_namespaces=True) if "EngineReplica" in a["name"]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="a checkpoint folder (default: the bundled model, or --shape)")
    ap.add_argument("--shape", help="random weights at this public shape (fastmamba.bench.SHAPES, Mamba-1)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--replicas", type=int, default=2, help="N: the GPUs to use (1 GPU a replica on CUDA)")
    ap.add_argument("--streams", default="64,256", help="streams a replica, at each level")
    ap.add_argument("--requests", type=int, default=2, help="requests a level, as a multiple of its streams")
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--max-batch", type=int, default=None)
    ap.add_argument("--chat", default="100x4", help="CONVERSATIONSxTURNS")
    ap.add_argument("--chat-tokens", type=int, default=64, help="tokens an answer in the chat")
    ap.add_argument("--prefix-cache-mb", type=int, default=None,
                    help="each replica's prefix cache, MiB (default: room for every conversation's states of two turns; "
                    "serve's own default, 256 MiB, holds 10 states of a 2.8b model, fewer than the chat's conversations)")
    ap.add_argument("--stream-intervals", default="50",
                    help="the replicas' stream_interval_ms: the throughput runs take each, the others the first")
    ap.add_argument("--baseline", action="store_true", help="first plain `fastmamba serve` at the same levels")
    ap.add_argument("--measures", default="throughput,chat,kill", help="which of the runs, comma-separated")
    ap.add_argument("--json")
    args = ap.parse_args()

    import ray
    from ray import serve

    import fastmamba.bench as bench
    from fastmamba.core.config import MambaConfig

    folder = args.model
    if args.shape:
        folder = tempfile.mkdtemp(prefix=f"fastmamba-{args.shape}-")
        bench.write_random_checkpoint(args.shape, folder, getattr(__import__("torch"), args.dtype))
    from fastmamba.io.folders import checkpoint_folder

    folder = str(checkpoint_folder(folder))
    config = MambaConfig.from_file(Path(folder) / "config.json")
    vocab = config.vocab_size
    conversations, turns = (int(x) for x in args.chat.split("x"))
    if args.prefix_cache_mb is None:  # each turn leaves two states (its prompt's end, its answer's); with room
        # for one turn's only, the LRU drops a conversation's last turn while the others' turns arrive
        # (1 replica, 100 conversations, 2.8b: 0.4-0.6 of later turns resumed, against none at 256 MiB)
        args.prefix_cache_mb = 4 * conversations * prefix_state_bytes(config) // 2**20 + 64
    levels = [int(x) for x in args.streams.split(",")]
    measures = set(args.measures.split(","))
    rows = []

    def emit(**row):
        rows.append(row)
        print(json.dumps(row), flush=True)

    def free_port() -> int:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    plain = {}
    if args.baseline:  # 0. one engine without Ray, before Ray takes the GPUs
        port = free_port()
        proc = plain_server(args, folder, port)
        try:
            for streams in levels:
                results, wall = asyncio.run(completions(f"http://127.0.0.1:{port}", streams, streams * args.requests,
                                                        args.prompt_tokens, args.max_tokens, vocab, seed=streams))
                plain[streams] = summary(results, wall)
                emit(measure="throughput", server="fastmamba serve", replicas=1, streams=streams, **plain[streams])
        finally:
            proc.terminate()
            proc.wait(60)
    gpus = args.replicas if args.device != "cpu" else 0
    ray.init(num_gpus=gpus or None, num_cpus=max(4, args.replicas + 2), include_dashboard=False, logging_level="ERROR")
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    url = f"http://127.0.0.1:{port}"
    try:
        runs = itertools.product(sorted({1, args.replicas}), [float(x) for x in args.stream_intervals.split(",")])
        for replicas, interval in runs if "throughput" in measures else ():  # 1. 1 replica and N
            start_app(args, folder, replicas, "prefix", port, interval)
            for per in levels:
                streams = per * replicas
                results, wall = asyncio.run(completions(url, streams, streams * args.requests, args.prompt_tokens,
                                                        args.max_tokens, vocab, seed=streams))
                row = summary(results, wall)
                if replicas == 1 and streams in plain:  # Ray's share: throughput lost against one plain engine
                    row["ray_overhead"] = round(1 - row["tokens_per_s"] / plain[streams]["tokens_per_s"], 4)
                emit(measure="throughput", server="ray serve", replicas=replicas, stream_interval_ms=interval,
                     streams=streams, **row)
            serve.delete("fastmamba")
        for routing in ("round-robin", "prefix") if "chat" in measures else ():  # 2. the chat, by routing
            start_app(args, folder, args.replicas, routing, port)
            turns_rows = asyncio.run(chat(url, conversations, turns, args.chat_tokens))
            later = [r for r in turns_rows if r["turn"] > 0]
            emit(measure="chat", routing=routing, replicas=args.replicas, conversations=conversations, turns=turns,
                 failed=sum(not r["ok"] for r in turns_rows),
                 later_turns_resumed=round(sum(r["hit"] for r in later) / max(1, len(later)), 3),
                 later_ttft_p50_s=pct([r["ttft"] for r in later if r["ok"]], 0.5),
                 later_ttft_p99_s=pct([r["ttft"] for r in later if r["ok"]], 0.99))
        if "kill" not in measures:
            return
        # 3. a replica killed 2 s into a run at the first level's streams (the prefix app still up)
        if "chat" not in measures:
            start_app(args, folder, args.replicas, "prefix", port)
        streams = levels[0] * args.replicas

        async def kill_soon():
            await asyncio.sleep(2)
            victim = replica_actors()[0]
            ray.kill(ray.get_actor(victim["name"], namespace=victim["namespace"]), no_restart=True)

        t_kill = time.perf_counter() + 2
        results, wall = asyncio.run(completions(url, streams, 2 * streams * args.requests, args.prompt_tokens,
                                                args.max_tokens, vocab, seed=7, on_start=kill_soon))
        t0 = min(t for r in results for t in r["times"][:1]) if any(r["times"] for r in results) else t_kill
        per_second = {}
        for r in results:
            for t in r["times"]:
                per_second[int(t - t0)] = per_second.get(int(t - t0), 0) + 1
        emit(measure="kill", replicas=args.replicas, streams=streams, killed_at_s=round(t_kill - t0, 2),
             lost=sum(r["status"] not in (200, 503) or (r["status"] == 200 and r["tokens"] == 0) for r in results),
             tokens_each_second=[per_second.get(k, 0) for k in range(max(per_second, default=-1) + 1)],
             **summary(results, wall))
    finally:
        serve.shutdown()
        ray.shutdown()
        if args.json:
            Path(args.json).write_text(json.dumps(dict(command=" ".join(sys.argv), rows=rows), indent=2))


if __name__ == "__main__":
    main()
