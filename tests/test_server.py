"""`fastmamba serve` end to end: a server subprocess on a loopback port, driven with the
real `openai` client and plain HTTP. Every request loop is bounded in count and time."""

from __future__ import annotations

import concurrent.futures
import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

import fastmamba

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`fastmamba serve` in a subprocess on a free loopback port, its output (stdout and
    stderr) in a file: `output()` reads it. `env`: variables to add (TMPDIR, say);
    `preexec_fn`: run in the child before it starts (a lower open-file limit, say)."""

    def __init__(self, *flags: str, env: dict | None = None, preexec_fn=None):
        import tempfile

        self.port = free_port()
        self.key = flags[flags.index("--api-key") + 1] if "--api-key" in flags else None
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.TemporaryFile(mode="w+")
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.proc = subprocess.Popen([sys.executable, "-m", "fastmamba.cli", "serve", "--port", str(self.port), *flags],
                                     stdout=self.log, stderr=subprocess.STDOUT, text=True, env=env,
                                     preexec_fn=preexec_fn)
        deadline = time.time() + 90
        while time.time() < deadline:
            try:
                urllib.request.urlopen(self.url + "/health", timeout=2)
                return
            except OSError:
                if self.proc.poll() is not None:
                    raise RuntimeError(self.output())
                time.sleep(0.3)
        raise RuntimeError("the server did not start in 90 s")

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read()

    def client(self, **kw):
        return openai.OpenAI(base_url=self.url + "/v1", api_key=kw.pop("api_key", "none"), max_retries=0, timeout=120, **kw)

    def post(self, path: str, body, headers=None) -> tuple[int, dict]:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, headers={"Content-Type": "application/json", **(headers or {})})
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def get(self, path: str) -> str:
        headers = {"Authorization": f"Bearer {self.key}"} if self.key else {}
        with urllib.request.urlopen(urllib.request.Request(self.url + path, headers=headers), timeout=30) as r:
            return r.read().decode()

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()


@pytest.fixture(scope="module")
def server():
    s = Server("--max-batch", "16", "--served-model-name", "tiny")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def lm():
    return fastmamba.load()


def test_seeded_completion_equals_generate_alone(server, lm):
    c = server.client()
    out = c.completions.create(model="tiny", prompt="To be, or not to be", max_tokens=20, temperature=0.8, top_p=0.95, seed=5)
    expected = lm.generate("To be, or not to be", max_tokens=20, temperature=0.8, top_p=0.95, seed=5)
    assert out.choices[0].text == expected.text
    assert out.usage.prompt_tokens == expected.prompt_tokens and out.usage.completion_tokens == len(expected.token_ids)
    assert out.choices[0].finish_reason == "length" and out.id.startswith("cmpl-")


def test_stream_equals_non_stream(server):
    c = server.client()
    kw = dict(model="tiny", prompt="ROMEO.", max_tokens=24, temperature=0.7, seed=9)
    whole = c.completions.create(**kw).choices[0].text
    chunks = list(c.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == whole
    assert chunks[-1].usage.completion_tokens == 24 and not chunks[-1].choices
    chat = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hail"}], max_tokens=12, seed=2)
    streamed = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hail"}], max_tokens=12, seed=2, stream=True)
    assert "".join(ch.choices[0].delta.content or "" for ch in streamed) == chat.choices[0].message.content


@pytest.mark.parametrize("options, stream, words", [
    ({"include_usage": "no"}, True, "'stream_options.include_usage' must be true or false"),
    ({"include_usage": 1}, True, "'stream_options.include_usage' must be true or false"),
    ({"include_usge": True}, True, "unrecognized field 'stream_options.include_usge'"),
    ({"include_usage": True}, False, "only be given when 'stream' is true"),
    ({"include_usage": False}, None, "only be given when 'stream' is true"),
    ("yes", True, "'stream_options' must be an object"),
])
def test_stream_options_are_checked_as_openai_checks_them(server, options, stream, words):
    for path, body in (("/v1/completions", {"prompt": "To be"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hail"}]})):
        body = {**body, "max_tokens": 2, "stream_options": options, **({} if stream is None else {"stream": stream})}
        status, out = server.post(path, body)
        assert status == 400 and out["error"]["param"] == "stream_options" and words in out["error"]["message"], out


def test_stream_options_that_ask_nothing_pass(server):
    c = server.client()
    assert c.completions.create(model="tiny", prompt="To be", max_tokens=2, extra_body={"stream_options": {}}).choices
    chunks = list(c.completions.create(model="tiny", prompt="To be", max_tokens=2, stream=True,
                                       stream_options={"include_usage": False}))
    assert chunks and all(ch.usage is None for ch in chunks)


def test_chat_uses_the_plain_template(server, lm):
    c = server.client()
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Who art thou?"}]
    out = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=16, temperature=0)
    prompt = "system: Be brief.\nuser: Who art thou?\nassistant:"
    assert out.choices[0].message.content == lm.generate(prompt, max_tokens=16).text
    assert out.choices[0].message.role == "assistant" and out.object == "chat.completion"


def test_64_concurrent_streams_each_get_what_they_get_alone(server, lm):
    def one(seed):
        c = server.client()
        stream = c.completions.create(model="tiny", prompt="KING.", max_tokens=10, temperature=0.9, seed=seed, stream=True)
        return "".join(ch.choices[0].text for ch in stream if ch.choices)

    with concurrent.futures.ThreadPoolExecutor(64) as pool:
        texts = list(pool.map(one, range(64), timeout=300))
    for seed, text in enumerate(texts):
        assert text == lm.generate("KING.", max_tokens=10, temperature=0.9, seed=seed).text, seed
    assert len(set(texts)) > 32  # the seeds really differ


def test_stop_strings_end_the_text_and_never_split_across_chunks(server, lm):
    full = lm.generate("To be, or not to be", max_tokens=30).text  # " a king,\nAnd to the world, ..."
    stop = full[12:16]
    c = server.client()
    out = c.completions.create(model="tiny", prompt="To be, or not to be", max_tokens=30, temperature=0, stop=[stop, "zzz"])
    assert out.choices[0].text == full[: full.index(stop)] and out.choices[0].finish_reason == "stop"
    chunks = [ch.choices[0].text for ch in c.completions.create(
        model="tiny", prompt="To be, or not to be", max_tokens=30, temperature=0, stop=[stop], stream=True) if ch.choices]
    assert "".join(chunks) == out.choices[0].text and all(stop not in ch for ch in chunks)


def test_n_choices_take_consecutive_seeds(server, lm):
    c = server.client()
    out = c.completions.create(model="tiny", prompt="HAMLET.", max_tokens=8, temperature=1.0, seed=40, n=3)
    assert [ch.index for ch in out.choices] == [0, 1, 2]
    for k, ch in enumerate(out.choices):
        assert ch.text == lm.generate("HAMLET.", max_tokens=8, temperature=1.0, seed=40 + k).text


def test_logprobs(server):
    c = server.client()
    out = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=5,
                                    temperature=0, logprobs=True, top_logprobs=3)
    entries = out.choices[0].logprobs.content
    assert len(entries) == 5 and all(len(e.top_logprobs) == 3 for e in entries)
    for e in entries:  # greedy: the chosen token is the most likely one
        assert e.logprob == pytest.approx(e.top_logprobs[0].logprob) and e.logprob <= 0
    comp = c.completions.create(model="tiny", prompt="Hi", max_tokens=4, temperature=0, logprobs=2)
    lp = comp.choices[0].logprobs
    assert len(lp.tokens) == 4 and len(lp.token_logprobs) == 4 and all(len(t) == 2 for t in lp.top_logprobs)
    assert "".join(lp.tokens) == comp.choices[0].text
    text = comp.choices[0].text
    assert [text[at:at + len(t)] for at, t in zip(lp.text_offset, lp.tokens)] == lp.tokens
    # echoed: the offsets index the returned text, the prompt first; streamed: the same offsets
    echoed = c.completions.create(model="tiny", prompt="Hi", max_tokens=4, temperature=0, logprobs=1, echo=True)
    e = echoed.choices[0]
    assert e.text == "Hi" + text and e.logprobs.text_offset == [2 + at for at in lp.text_offset]
    streamed = [ch.choices[0] for ch in c.completions.create(model="tiny", prompt="Hi", max_tokens=4, temperature=0,
                                                           logprobs=1, echo=True, stream=True) if ch.choices]
    offsets = [at for ch in streamed if ch.logprobs for at in ch.logprobs.text_offset]
    assert offsets == e.logprobs.text_offset and "".join(ch.text for ch in streamed) == e.text


def test_echo_token_prompts_and_batches(server, lm):
    c = server.client()
    out = c.completions.create(model="tiny", prompt="To be", max_tokens=5, temperature=0, echo=True)
    assert out.choices[0].text == "To be" + lm.generate("To be", max_tokens=5).text
    ids = lm.encode("To be")
    both = c.completions.create(model="tiny", prompt=[ids, "ROMEO."], max_tokens=5, temperature=0)
    assert [ch.text for ch in both.choices] == [lm.generate(ids, max_tokens=5).text, lm.generate("ROMEO.", max_tokens=5).text]


def test_prefix_cache_hit_gives_the_cold_tokens(server, lm):
    c = server.client()
    from fastmamba.engine.prefix_cache import INTERVAL

    long_prompt = "Now is the winter of our discontent made glorious summer by this sun of York. " * 32
    assert len(lm.encode(long_prompt)) > INTERVAL
    cold = c.completions.create(model="tiny", prompt=long_prompt, max_tokens=12, temperature=0)
    hot = c.completions.create(model="tiny", prompt=long_prompt, max_tokens=12, temperature=0)
    assert hot.choices[0].text == cold.choices[0].text
    assert hot.usage.prompt_tokens_details.cached_tokens == hot.usage.prompt_tokens
    longer = c.completions.create(model="tiny", prompt=long_prompt + "And all the clouds", max_tokens=12, temperature=0)
    assert longer.usage.prompt_tokens_details.cached_tokens >= INTERVAL
    assert longer.choices[0].text == lm.generate(long_prompt + "And all the clouds", max_tokens=12).text
    metrics = server.get("/metrics")
    assert "fastmamba:prefix_cache_hits_total" in metrics


def test_errors_are_openai_bodies(server):
    def expect(status, path, body, param=None, code=None, says=""):
        got, err = server.post(path, body)
        assert got == status, err
        assert set(err["error"]) == {"message", "type", "param", "code"} and err["error"]["message"]
        assert says in err["error"]["message"], err
        if param:
            assert err["error"]["param"] == param
        if code:
            assert err["error"]["code"] == code

    expect(400, "/v1/completions", {"prompt": "x", "temperature": -1}, param="temperature")
    expect(400, "/v1/completions", {"prompt": "x", "max_tokens": "many"}, param="max_tokens")
    expect(400, "/v1/completions", {"prompt": "x", "top_p": 1e39}, param="top_p")
    expect(400, "/v1/completions", {"prompt": "x", "seed": 2**40}, param="seed")
    expect(400, "/v1/completions", {"prompt": [10**7]}, param="prompt", says="10000000")
    expect(400, "/detokenize", {"tokens": [1, -3]}, param="tokens", says="-3")
    expect(400, "/v1/completions", {"prompt": "x", "n": 100}, param="n")
    expect(400, "/v1/completions", {}, param="prompt")
    expect(400, "/v1/completions", b"{not json")
    expect(400, "/v1/completions", {"prompt": "x " * 40000}, param="prompt", code="context_length_exceeded")
    expect(400, "/v1/chat/completions", {"messages": "hi"}, param="messages")
    expect(400, "/v1/completions", {"prompt": "x", "stop_token_ids": [10**6]}, param="stop_token_ids", says="1000000")
    expect(400, "/v1/completions", {"prompt": "x", "stop_token_ids": [2.5]}, param="stop_token_ids", says="2.5")
    expect(404, "/v1/completions", {"prompt": "x", "model": "gpt-4"}, param="model", code="model_not_found")
    expect(404, "/v1/nothing", {})
    c = server.client()
    with pytest.raises(openai.BadRequestError):
        c.completions.create(model="tiny", prompt="x", temperature=-2)
    assert c.completions.create(model="tiny", prompt="x", max_tokens=2).choices  # still serving


def test_models_tokenize_detokenize_metrics(server, lm):
    assert [m.id for m in server.client().models.list().data] == ["tiny"]
    status, tok = server.post("/tokenize", {"prompt": "To be, or not"})
    assert status == 200 and tok["tokens"] == lm.encode("To be, or not") and tok["count"] == len(tok["tokens"])
    status, detok = server.post("/detokenize", {"tokens": tok["tokens"]})
    assert status == 200 and detok["prompt"] == "To be, or not"
    text = server.get("/metrics")
    for name in ["time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
                 "request_queue_time_seconds", "num_requests_running", "num_requests_waiting", "state_slots_used",
                 "prompt_tokens_total", "generation_tokens_total", "prefix_cache_queries_total",
                 "prefix_cache_hits_total", "request_success_total"]:
        assert f"fastmamba:{name}" in text, name


def gauge(server, name: str) -> float:
    for line in server.get("/metrics").splitlines():
        if line.startswith(f"fastmamba:{name} "):
            return float(line.split()[1])
    raise AssertionError(f"no fastmamba:{name}")


def running(server) -> float:
    return gauge(server, "num_requests_running")


def test_a_disconnect_frees_the_slot(server):
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    body = json.dumps({"prompt": "To be", "max_tokens": 20000, "stream": True, "temperature": 0, "stop_token_ids": []})
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    resp.read1(200)  # the first chunks
    assert running(server) >= 1
    conn.close()
    deadline = time.time() + 30
    while running(server) and time.time() < deadline:
        time.sleep(0.2)
    assert running(server) == 0


def test_api_key_and_queue_limit():
    s = Server("--api-key", "sesame", "--max-batch", "1", "--max-queue", "1")
    try:
        with urllib.request.urlopen(s.url + "/health", timeout=30) as r:  # open without the key,
            assert r.status == 200  # as load balancers expect
        with pytest.raises(urllib.error.HTTPError, match="401"):
            urllib.request.urlopen(s.url + "/metrics", timeout=30)
        with pytest.raises(openai.AuthenticationError):
            s.client(api_key="wrong").completions.create(model="x", prompt="a", max_tokens=1)
        c = s.client(api_key="sesame")
        name = c.models.list().data[0].id
        # the scheme in any case (RFC 9110), the key exactly; another scheme is refused
        for header, status in (("bearer sesame", 200), ("BEARER  sesame", 200), ("Basic sesame", 401),
                               ("Bearer sesame2", 401), ("Bearer", 401)):
            request = urllib.request.Request(s.url + "/v1/models", headers={"Authorization": header})
            try:
                with urllib.request.urlopen(request, timeout=30) as r:
                    got = r.status
            except urllib.error.HTTPError as e:
                got = e.code
            assert got == status, header
        # a 401 goes out before the body is read: the connection closes with it (the body's
        # unread rest would hold it open)
        sock = socket.create_connection(("127.0.0.1", s.port), timeout=10)
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{")
        answer, t0 = b"", time.time()
        while chunk := sock.recv(4096):
            answer += chunk
        sock.close()
        assert answer.startswith(b"HTTP/1.1 401") and b"connection: close" in answer.lower() and time.time() - t0 < 3
        assert c.completions.create(model=name, prompt="a", max_tokens=2).choices
        # one request runs, one waits, the next is refused with 429. The second is sent only
        # once the first runs: sent together, the second can find the first still queued (a
        # loaded 2-core machine can be slow to admit it) and be refused itself.
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            def send_long():
                return pool.submit(c.completions.create, model=name, prompt="a", max_tokens=20000, temperature=0,
                                   extra_body={"stop_token_ids": []})

            def wait_for(want):
                deadline = time.time() + 120
                while (busy := (running(s), gauge(s, "num_requests_waiting"))) != want and time.time() < deadline:
                    time.sleep(0.2)
                assert busy == want, f"(running, waiting) stayed {busy}, not {want}"

            long = [send_long()]
            wait_for((1, 0))
            long.append(send_long())
            wait_for((1, 1))
            with pytest.raises(openai.RateLimitError) as busy:
                c.completions.create(model=name, prompt="a", max_tokens=1)
            assert busy.value.response.headers.get("retry-after") == "1"  # (RFC 6585; OpenAI's clients wait that long)
            s.stop()  # ends the two long requests (their errors are expected)
            for f in long:
                with pytest.raises(Exception):
                    f.result(timeout=60)
    finally:
        s.stop()



def test_a_streamed_tokens_chunk_is_the_chunk_json_would_give():
    """Response.sse_chunk's template (made once a choice) against the chunk's own JSON, for
    texts that JSON must escape."""
    from fastmamba.serve.responses import Response, sse

    for chat in (False, True):
        shape = Response("cmpl-1", "m", chat, None, ["", ""])
        for piece in ("hello", "", 'a"b\\\n\u00e9\u0000', "日本", "\u2028"):
            want = sse(shape.chunk(1, {"content": piece} if chat else piece, None, None))
            assert shape.sse_chunk(1, piece, None, None) == want


def test_a_chats_second_turn_resumes_from_the_first_turns_state(server, lm):
    """The state kept at the end of turn 1 (prompt + answer) is where turn 2's prompt
    starts: turn 2 prefills only the new message."""
    c = server.client()
    newline = lm.encode("\n")
    msgs = [{"role": "user", "content": "Speak, good sir."}]
    first = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=40, temperature=0,
                                      extra_body={"stop_token_ids": newline})
    answer = first.choices[0].message.content
    assert first.choices[0].finish_reason == "stop" and answer
    msgs += [{"role": "assistant", "content": answer}, {"role": "user", "content": "More, I pray thee."}]
    second = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=8, temperature=0)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= first.usage.prompt_tokens + first.usage.completion_tokens
    assert second.usage.prompt_tokens - cached <= len(lm.encode("\nuser: More, I pray thee.\nassistant:"))
    prompt = f"user: Speak, good sir.\nassistant:{answer}\nuser: More, I pray thee.\nassistant:"
    assert second.choices[0].message.content == lm.generate(prompt, max_tokens=8).text


def engine_pid(server_pid: int) -> int:
    """The engine process: the server's child that multiprocessing spawned."""
    with open(f"/proc/{server_pid}/task/{server_pid}/children") as f:
        children = [int(p) for p in f.read().split()]
    for pid in children:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"spawn_main" in f.read():
                return pid
    raise AssertionError(f"no engine process among {children}")


def test_a_dead_engine_gives_503s_at_once():
    import signal

    s = Server("--max-model-len", "20000")
    try:
        c = s.client()
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            pending = pool.submit(c.completions.create, model=c.models.list().data[0].id, prompt="To be",
                                  max_tokens=10000, extra_body={"stop_token_ids": []})
            deadline = time.time() + 60
            while running(s) < 1 and time.time() < deadline:
                time.sleep(0.1)
            os.kill(engine_pid(s.proc.pid), signal.SIGKILL)
            t0 = time.time()
            with pytest.raises(openai.InternalServerError) as e:
                pending.result(timeout=10)
            assert e.value.status_code == 503 and time.time() - t0 < 1.5
        for _ in range(20):  # the health check follows within a second
            try:
                urllib.request.urlopen(s.url + "/health", timeout=5)
            except urllib.error.HTTPError as err:
                assert err.code == 503
                break
            time.sleep(0.05)
        else:
            raise AssertionError("/health stayed 200")
        t0 = time.time()
        status, body = s.post("/v1/completions", {"prompt": "To be", "max_tokens": 3})
        assert status == 503 and body["error"]["code"] == "engine_unavailable" and time.time() - t0 < 1
    finally:
        s.stop()


def test_the_engine_process_ends_with_its_front_end():
    """A front end killed outright (or ended at once by Ctrl-C while loading) leaves no
    engine process behind."""
    import signal

    s = Server()
    pid = engine_pid(s.proc.pid)
    s.proc.send_signal(signal.SIGKILL)
    s.proc.wait(timeout=30)
    deadline = time.time() + 10
    while time.time() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X"):  # ended, not yet reaped
                    return
        except FileNotFoundError:
            return
        time.sleep(0.1)
    raise AssertionError("the engine process outlived its front end by 10 s")


def test_the_http_process_imports_no_torch():
    """The front end (options, app, chat template, engine client and protocol) runs without
    the model stack: building serve's app for the bundled model imports no torch."""
    code = """
import sys
from fastmamba.engine.client import EngineClient
from fastmamba.engine.process import ProcessClient
from fastmamba.io.folders import checkpoint_folder
from fastmamba.serve.app import folder_app
from fastmamba.serve.main import serve
from fastmamba.serve.options import ServeOptions

class Idle(EngineClient):
    max_batch = 1
    alive = True
    def submit(self, *a, **k): raise AssertionError
    def abort(self, rid): pass

folder_app(Idle(), checkpoint_folder(None), ServeOptions())
assert "torch" not in sys.modules, sorted(m for m in sys.modules if m.startswith("fastmamba"))
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]


def test_a_kv_cache_smaller_than_max_model_len_bounds_requests_and_chats_default(tmp_path):
    """A hybrid served with a KV cache of ~500 tokens a request (--kv-cache-mb 1), under
    --max-model-len 32768: the start says so; a chat without max_tokens runs to the cache's
    room (it asked for 32768 less its prompt, which could never fit), and a request past it
    is a 400 saying why."""
    import torch
    from conftest import make_tokenizer
    from transformers import NemotronHConfig, NemotronHForCausalLM

    folder = tmp_path / "hybrid"
    folder.mkdir()
    vocab = make_tokenizer(folder / "tokenizer.json")
    torch.manual_seed(0)
    config = NemotronHConfig(vocab_size=vocab, hidden_size=64, layers_block_type=["mamba", "attention", "mlp"],
                             num_attention_heads=4, num_key_value_heads=4, head_dim=64, intermediate_size=96,
                             mamba_num_heads=8, mamba_head_dim=16, ssm_state_size=16, n_groups=2, chunk_size=8)
    NemotronHForCausalLM(config).save_pretrained(folder)
    s = Server("--model", str(folder), "--kv-cache-mb", "1", "--max-batch", "2", "--max-model-len", "32768")
    try:
        # 1 MiB at 2 KiB a token (one attention layer: keys and values, 4 heads of 64, float32)
        notice = [line for line in s.output().splitlines() if "the KV cache holds" in line]
        assert len(notice) == 1 and "fewer than --max-model-len 32768" in notice[0], s.output()
        context = int(notice[0].split("holds ")[1].split()[0])
        assert 256 <= context <= 512
        status, body = s.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                       "stop_token_ids": []})  # (the reply runs to its limit)
        assert status == 200, body
        usage = body["usage"]
        assert body["choices"][0]["finish_reason"] == "length"
        assert usage["prompt_tokens"] + usage["completion_tokens"] == context
        status, body = s.post("/v1/completions", {"prompt": "hi", "max_tokens": context})
        assert status == 400 and body["error"]["code"] == "context_length_exceeded", body
        assert f"limit of {context} (what its KV cache holds a request)" in body["error"]["message"]
    finally:
        s.stop()
