"""`fastmamba serve` under hostile conditions: clients that hang up, signals, huge bodies,
malformed fields, a soak of mixed requests and fuzzed bodies. A real server subprocess on a
loopback port; every request loop is bounded in count and time."""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import os
import signal
import time

import pytest
from test_server import Server, engine_pid, gauge, running

openai = pytest.importorskip("openai")
hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st

LIMIT = 96  # --max-model-len of the shared server: anything it accepts finishes fast on a CPU


@pytest.fixture(scope="module")
def server():
    s = Server("--max-batch", "4", "--max-model-len", str(LIMIT), "--max-body-mb", "1", "--served-model-name", "tiny")
    yield s
    s.stop()


def long_request(port: int, stream: bool, max_tokens: int = 10**4) -> http.client.HTTPConnection:
    """A request that runs long (no stop token), sent and left running."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    body = {"prompt": "To be", "max_tokens": max_tokens, "temperature": 0, "stop_token_ids": [], "stream": stream}
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    return conn


def wait_until(predicate, seconds: float, what: str) -> None:
    deadline = time.time() + seconds
    while not predicate():
        assert time.time() < deadline, f"{what} did not happen in {seconds} s"
        time.sleep(0.1)


def test_a_non_streaming_client_that_hangs_up_frees_its_slot():
    s = Server("--max-model-len", "20000")
    try:
        conn = long_request(s.port, stream=False)
        wait_until(lambda: running(s) == 1, 60, "the request running")
        conn.sock.close()
        conn.close()
        t0 = time.time()
        wait_until(lambda: running(s) == 0, 10, "the slot freed")
        assert time.time() - t0 < 3
    finally:
        s.stop()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
@pytest.mark.parametrize("second", [False, True])
def test_a_signal_drains_then_exits_zero(sig, second, tmp_path):
    """The drain ends open requests with 503s at --shutdown-timeout; a second signal ends
    them at once the same way (it gave plain-text 500s and cut streams, or did nothing)."""
    drain = 60 if second else 2
    s = Server("--max-model-len", "20000", "--shutdown-timeout", str(drain), env={"TMPDIR": str(tmp_path)})
    try:
        streaming = long_request(s.port, stream=True)
        resp = streaming.getresponse()
        assert resp.status == 200 and resp.read1(100)
        plain = long_request(s.port, stream=False)
        wait_until(lambda: running(s) == 2, 60, "both requests running")
        t0 = time.time()
        s.proc.send_signal(sig)
        if second:
            time.sleep(0.5)
            s.proc.send_signal(sig)
        answer = plain.getresponse()
        assert answer.status == 503 and json.loads(answer.read())["error"]["code"] == "server_shutting_down"
        tail = resp.read().decode()
        assert "server_shutting_down" in tail and tail.endswith("data: [DONE]\n\n")
        assert s.proc.wait(timeout=90) == 0
        assert time.time() - t0 < 10  # the 2 s drain then a prompt exit; not the 60 s one after a second signal
        assert not list(tmp_path.glob("fastmamba-*"))  # the engine's socket folder goes with it
        with pytest.raises(OSError):  # no longer accepting
            http.client.HTTPConnection("127.0.0.1", s.port, timeout=5).request("GET", "/health")
    finally:
        s.stop()


def test_an_engine_killed_mid_request_zeroes_the_gauges_and_is_logged():
    s = Server("--max-model-len", "20000")
    try:
        streams = [long_request(s.port, stream=True).getresponse() for _ in range(2)]
        assert all(resp.status == 200 and resp.read1(100) for resp in streams)
        wait_until(lambda: running(s) == 2, 60, "both requests running")
        os.kill(engine_pid(s.proc.pid), signal.SIGKILL)
        for resp in streams:  # each ends with its error event (the engine is gone)
            assert "engine_unavailable" in resp.read().decode()
        assert running(s) == 0 and gauge(s, "state_slots_used") == 0 and gauge(s, "num_requests_waiting") == 0
        died = [line for line in s.output().splitlines() if "engine process died" in line]
        assert died == ["fastmamba: the engine process died (exit code -9); the server cannot serve"]
    finally:
        s.stop()


def test_an_idle_server_exits_at_once_on_sigterm():
    s = Server()
    t0 = time.time()
    s.proc.send_signal(signal.SIGTERM)
    assert s.proc.wait(timeout=30) == 0 and time.time() - t0 < 5


def test_a_body_over_the_limit_gets_413_at_once(server):
    t0 = time.time()
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    conn.putrequest("POST", "/v1/completions")  # 50 MB announced, a few bytes sent
    conn.putheader("Content-Type", "application/json")
    conn.putheader("Content-Length", str(50 << 20))
    conn.endheaders()
    conn.send(b'{"prompt": "' + b"a" * 1000)
    resp = conn.getresponse()
    err = json.loads(resp.read())["error"]
    assert resp.status == 413 and err["code"] == "request_too_large" and "--max-body-mb" in err["message"]
    assert time.time() - t0 < 2
    # without Content-Length (chunked): counted as it comes
    chunked = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    body = (b'{"prompt": [' + b"1," * (1 << 19) + b"1]}",)  # ~1 MiB of ids
    chunked.request("POST", "/v1/completions", body=iter(body), headers={"Content-Type": "application/json"},
                    encode_chunked=True)
    resp = chunked.getresponse()
    assert resp.status == 413 and json.loads(resp.read())["error"]["code"] == "request_too_large"
    assert server.client().completions.create(model="tiny", prompt="To be", max_tokens=2).choices  # still serving


@pytest.mark.parametrize("prompt", [[[[1, 2]]], [[1, [2]]], [["a"]], [[]], [{"a": 1}], [1, "a"], [[1, 2], [3.5]]])
def test_prompts_nested_past_one_level_are_refused(server, prompt):
    status, body = server.post("/v1/completions", {"prompt": prompt, "max_tokens": 2})
    assert status == 400 and body["error"]["param"] == "prompt"


def test_chat_honours_max_completion_tokens(server):
    c = server.client()
    msgs = [{"role": "user", "content": "Speak"}]
    out = c.chat.completions.create(model="tiny", messages=msgs, max_completion_tokens=3, temperature=0,
                                    extra_body={"stop_token_ids": []})
    assert out.usage.completion_tokens == 3 and out.choices[0].finish_reason == "length"
    same = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=3, max_completion_tokens=3, temperature=0,
                                     extra_body={"stop_token_ids": []})
    assert same.choices[0].message.content == out.choices[0].message.content
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="tiny", messages=msgs, max_tokens=3, max_completion_tokens=4)
    assert e.value.body["param"] == "max_completion_tokens"


def test_max_model_len_bounds_prompt_and_max_tokens(server):
    c = server.client()
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model="tiny", prompt="To be", max_tokens=10**12)
    assert e.value.body["param"] == "max_tokens" and e.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model="tiny", prompt=[1] * LIMIT, max_tokens=1)
    assert e.value.body["param"] == "prompt"
    # without max_tokens: completions give 16, as OpenAI's do; chat runs until the limit
    out = c.completions.create(model="tiny", prompt="To be", temperature=0, extra_body={"stop_token_ids": []})
    assert out.usage.completion_tokens == 16
    chat = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hail"}], temperature=0,
                                     extra_body={"stop_token_ids": []})
    assert chat.usage.prompt_tokens + chat.usage.completion_tokens == LIMIT


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def test_soak_of_good_bad_and_cancelled_requests(server):
    c = server.client()
    c.completions.create(model="tiny", prompt="warm up", max_tokens=4)
    idle_rss = rss_mb(server.proc.pid)
    bad = [{"prompt": "x", "temperature": -1}, {"prompt": [[[1]]]}, {"prompt": "x", "max_tokens": 10**9},
           {"prompt": [10**8]}, {"messages": "hi"}, {"prompt": "x", "n": 10**3}, b"{oops", {"prompt": "x", "seed": -4}]

    def one(i: int):
        kind = i % 4
        if kind == 0:
            out = c.completions.create(model="tiny", prompt=f"Act {i}.", max_tokens=4, temperature=0.8, seed=i)
            return "ok" if out.choices[0].text is not None else "?"
        if kind == 1:
            body = bad[i // 4 % len(bad)]
            path = "/v1/chat/completions" if isinstance(body, dict) and "messages" in body else "/v1/completions"
            status, err = server.post(path, body)
            return "refused" if 400 <= status < 500 and set(err["error"]) == {"message", "type", "param", "code"} else status
        # a request dropped while it runs: streaming after its first chunk, or not streaming
        conn = long_request(server.port, stream=kind == 2, max_tokens=LIMIT - 8)
        if kind == 2:
            resp = conn.getresponse()
            assert resp.status == 200
            resp.read1(50)
        conn.sock.close()
        conn.close()
        return "dropped"

    t0 = time.time()
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        outcomes = list(pool.map(one, range(200), timeout=50))
    assert outcomes.count("ok") == 50 and outcomes.count("refused") == 50 and outcomes.count("dropped") == 100, outcomes
    assert time.time() - t0 < 50
    wait_until(lambda: running(server) == 0 and gauge(server, "num_requests_waiting") == 0, 30, "the slots freed")
    out = c.completions.create(model="tiny", prompt="To be", max_tokens=5, temperature=0)
    assert out.usage.completion_tokens == 5
    assert rss_mb(server.proc.pid) < idle_rss + 150  # no request's memory left behind


JSON = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False) | st.text(max_size=20),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
                    max_leaves=12)
FIELDS = ["prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p", "n",
          "seed", "stop", "stream", "logprobs", "top_logprobs", "echo", "stop_token_ids", "repetition_penalty",
          "stream_options", "model", "user"]
BODIES = JSON | st.dictionaries(st.sampled_from(FIELDS), JSON, max_size=6) | st.fixed_dictionaries(
    {"prompt": st.text(max_size=30) | st.lists(st.integers(-5, 5000), max_size=5)},
    optional={f: JSON for f in FIELDS[2:]})


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(body=BODIES, chat=st.booleans())
def test_fuzzed_bodies_get_200_or_an_openai_4xx(server, body, chat):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.request("POST", "/v1/chat/completions" if chat else "/v1/completions", json.dumps(body),
                 {"Content-Type": "application/json"})
    resp = conn.getresponse()
    raw = resp.read()  # a JSON body, or a whole event stream
    assert resp.status == 200 or 400 <= resp.status < 500, (resp.status, raw[:300])
    if resp.status != 200:
        assert set(json.loads(raw)["error"]) == {"message", "type", "param", "code"}, raw
    elif resp.getheader("content-type", "").startswith("text/event-stream"):
        assert raw.endswith(b"data: [DONE]\n\n") and b'"server_error"' not in raw, raw[-300:]
