"""`fastmamba serve` against clients that are large, slow, hostile or mistaken: long prompts
leave the event loop free, a hostile chat template is a 400 naming it, slow clients cannot
hold the server, every client mistake is a 4xx. A real server subprocess on a loopback
port; every loop is bounded in count and time."""

from __future__ import annotations

import http.client
import json
import shutil
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest
from test_server import Server

pytest.importorskip("fastapi")

CLIENT_TIMEOUT = 1.5  # --client-timeout of the servers here


@pytest.fixture(scope="module")
def server():
    s = Server("--max-batch", "4", "--max-queue", "8", "--client-timeout", str(CLIENT_TIMEOUT))
    yield s
    s.stop()


def error(status_and_body, status: int) -> dict:
    got, body = status_and_body
    assert got == status, body
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def test_json_too_deep_or_with_a_huge_number_is_a_400_naming_it(server):
    deep = b'{"prompt": ' + b"[" * 50_000 + b"]" * 50_000 + b"}"
    assert "nested over 64" in error(server.post("/v1/completions", deep), 400)["message"]
    huge = b'{"prompt": "x", "seed": ' + b"7" * 5000 + b"}"
    assert "more than 100 digits" in error(server.post("/v1/completions", huge), 400)["message"]
    chat = b'{"messages": [{"role": "user", "content": "hi"}], "n": ' + b"1" * 5000 + b"}"
    assert "more than 100 digits" in error(server.post("/v1/chat/completions", chat), 400)["message"]


def test_body_shape_check_reads_structure_not_strings():
    from fastmamba.serve.errors import APIError
    from fastmamba.serve.requests import MAX_DEPTH, check_shape

    check_shape(json.dumps({"p": "[" * 500 + "9" * 500, "q": 'a \\" [[[ "'}).encode())  # inside strings: text
    check_shape(json.dumps({"p": [[1, [2]], {"a": [3]}] * 100, "n": 10**99}).encode())
    nested = [1]
    for _ in range(MAX_DEPTH - 2):
        nested = [nested]
    check_shape(json.dumps({"p": nested}).encode())  # exactly MAX_DEPTH levels
    with pytest.raises(APIError, match=f"nested over {MAX_DEPTH}"):
        check_shape(json.dumps({"p": [nested]}).encode())
    with pytest.raises(APIError, match="more than 100 digits"):
        check_shape(b'{"n": 1e' + b"0" * 101 + b"}")


def test_chat_content_parts_that_are_not_text_strings_are_400s_naming_them(server):
    for text in (7, None, ["a"]):
        msgs = [{"role": "user", "content": [{"type": "text", "text": "ok"}, {"type": "text", "text": text}]}]
        err = error(server.post("/v1/chat/completions", {"messages": msgs}), 400)
        assert "messages[0].content[1].text" in err["message"] and err["param"] == "messages"
    msgs = [{"role": "system", "content": "hi"}, {"role": "user", "content": ["not a part"]}]
    assert "messages[1].content[0]" in error(server.post("/v1/chat/completions", {"messages": msgs}), 400)["message"]
    assert "messages[1].content[0]" in error(server.post("/tokenize", {"messages": msgs}), 400)["message"]


def test_a_request_that_can_never_fit_is_a_400_and_one_that_fits_runs(server):
    """4 slots + 8 queued: 4 prompts x n=4 can never be taken (a 400 saying why, which no
    retry passes); 4 x n=3 fills it exactly and runs."""
    prompts = [f"Act {k}." for k in range(4)]
    err = error(server.post("/v1/completions", {"prompt": prompts, "n": 4, "max_tokens": 1}), 400)
    assert err["param"] == "n" and "16" in err["message"] and "12" in err["message"]
    status, out = server.post("/v1/completions", {"prompt": prompts, "n": 3, "max_tokens": 1})
    assert status == 200 and len(out["choices"]) == 12


def test_a_long_prompt_leaves_health_and_streams_free(server):
    """A 3 MB prompt takes seconds to tokenize: meanwhile /health answers and a running
    stream keeps its pace (the tokenizer holds the interpreter lock: it runs in a worker)."""
    gaps, lat, done = [], [], threading.Event()

    def watch_stream():
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
        body = {"prompt": "To be", "max_tokens": 10**4, "temperature": 0, "stop_token_ids": [], "stream": True}
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        last = time.time()
        while not done.is_set() and resp.read1(4096):
            now = time.time()
            gaps.append(now - last)
            last = now
        conn.close()

    def watch_health():
        while not done.is_set():
            t0 = time.time()
            urllib.request.urlopen(server.url + "/health", timeout=30).read()
            lat.append(time.time() - t0)
            time.sleep(0.05)

    watchers = [threading.Thread(target=watch_stream), threading.Thread(target=watch_health)]
    for w in watchers:
        w.start()
    try:
        time.sleep(0.5)
        prompt = "hello world, this is text. " * (3_000_000 // 27)
        t0 = time.time()
        status, out = server.post("/tokenize", {"prompt": prompt})
        took = time.time() - t0
    finally:
        done.set()
        for w in watchers:
            w.join(60)
    assert status == 200 and out["count"] == len(out["tokens"]) > 1_000_000
    assert took > 1.5  # (long enough that a blocked loop would show: it stalled 5 s before)
    assert max(lat) < 2 and max(gaps[1:]) < 2, (max(lat), max(gaps[1:]), took)


def test_the_long_prompts_of_clients_that_hung_up_are_not_tokenized(server):
    """Nine clients send a 2 MB prompt (about 2 s of a worker each) and hang up: the jobs
    still queued are dropped, so a prompt sent after them waits for the two running at
    most, not for all nine."""
    text = ("To be or not to be that is the question " * 60000)[:2_000_000]
    for path, body in (("/v1/completions", {"prompt": text, "max_tokens": 1}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": text}], "max_tokens": 1}),
                       ("/tokenize", {"prompt": text})) * 3:
        data = json.dumps(body).encode()
        sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
        sock.sendall(b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
                     % (path.encode(), len(data)) + data)
        sock.close()
    time.sleep(1)
    t0 = time.time()
    status, out = server.post("/tokenize", {"prompt": "To be " * 1000})  # (a worker's job: over 4096 characters)
    assert status == 200 and out["count"] > 1000
    assert time.time() - t0 < 6  # (all nine run first: 9 s and more)


def hostile_model(tmp_path, template: str):
    from fastmamba.io.folders import default_model_dir

    folder = tmp_path / "model"
    folder.mkdir()
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        shutil.copy(default_model_dir() / name, folder / name)
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    return folder


def test_a_hostile_chat_template_is_a_400_naming_it_and_the_server_serves_on(tmp_path):
    """A template that renders without end (the issue's froze the server for a minute at
    3.7 GB): a 400 naming the template within a second or two, and the server serves on."""
    folder = hostile_model(tmp_path, "{% for i in range(100000) %}{% for m in messages %}"
                                     "{{ m['content'] * 100 }}{% endfor %}{% endfor %}")
    s = Server("--model", str(folder))
    try:
        t0 = time.time()
        err = error(s.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hello"}]}), 400)
        assert time.time() - t0 < 5
        assert err["code"] == "chat_template_failed" and str(folder / "tokenizer_config.json") in err["message"]
        assert "rendered over" in err["message"]
        status, out = s.post("/v1/completions", {"prompt": "To be", "max_tokens": 2})
        assert status == 200 and out["usage"]["completion_tokens"] == 2
    finally:
        s.stop()


def test_a_template_past_its_time_is_refused_and_its_worker_replaced(tmp_path):
    """A template that loops without output: its worker is killed at the time bound, the
    request refused naming the template, and the workers serve on."""
    import asyncio

    from fastmamba.io.prompts import PromptEncoder
    from fastmamba.io.tokenizer import Tokenizer
    from fastmamba.serve.chat import ChatTemplate, TemplateRefused
    from fastmamba.serve.prompt_workers import PromptWorkers

    folder = hostile_model(tmp_path, "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}")
    encoder = PromptEncoder(Tokenizer(folder / "tokenizer.json"), 50280, folder)
    workers = PromptWorkers(encoder, ChatTemplate(folder), count=1, render_timeout=1.0)

    async def run():
        t0 = time.time()
        with pytest.raises(TemplateRefused, match="took over 1 s") as e:
            await workers.chat([{"role": "user", "content": "hi"}])
        assert str(folder / "tokenizer_config.json") in str(e.value) and time.time() - t0 < 4
        text = "To be, or not to be. " * 1000  # (long: it goes to the new worker)
        assert await workers.encode(text) == encoder.encode(text)

    try:
        asyncio.run(run())
    finally:
        workers.close()


def test_a_dead_prompt_worker_is_replaced_and_its_job_run_on_the_replacement(monkeypatch):
    """Workers killed while idle: each next job runs on its worker's replacement; a job
    whose worker dies on it is not run again (it may be what killed it: a prompt past the
    memory) but a 503 naming the cause (never a 500)."""
    import asyncio
    import os
    import signal

    from fastmamba.io.folders import default_model_dir
    from fastmamba.io.prompts import PromptEncoder
    from fastmamba.io.tokenizer import Tokenizer
    from fastmamba.serve.chat import ChatTemplate
    from fastmamba.serve.errors import APIError
    from fastmamba.serve.prompt_workers import PromptWorkers, _Worker

    folder = default_model_dir()
    encoder = PromptEncoder(Tokenizer(folder / "tokenizer.json"), 50280, folder)
    workers = PromptWorkers(encoder, ChatTemplate(folder), count=2)
    text = "To be, or not to be. " * 1000  # (long: a worker's job)
    ids = encoder.encode(text)

    async def run():
        assert await asyncio.gather(workers.encode(text), workers.encode(text)) == [ids, ids]
        for pid in [w.proc.pid for w in _idle_workers(workers)]:
            os.kill(pid, signal.SIGKILL)
        time.sleep(0.5)
        assert [await workers.encode(text) for _ in range(3)] == [ids] * 3
        assert await workers.decode(ids) == text
        calls = []

        def dies(self, job, timeout):
            calls.append(job[0])
            raise EOFError

        monkeypatch.setattr(_Worker, "call", dies)
        with pytest.raises(APIError) as e:
            await workers.encode(text)
        assert calls == ["encode"]  # (not again on the replacement)
        assert e.value.status == 503 and e.value.code == "prompt_worker_failed" and "died" in e.value.message

    try:
        asyncio.run(run())
    finally:
        workers.close()


def _idle_workers(workers) -> list:
    """The idle workers, taken out of their queue and put back."""
    import queue

    taken = []
    while True:
        try:
            taken.append(workers._idle.get_nowait())
        except queue.Empty:
            break
    for worker in taken:
        workers._idle.put(worker)
    return taken


def slow_socket(port: int) -> socket.socket:
    """A connection that sends half a request's headers, then nothing."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application")
    return sock


def test_slow_clients_are_refused_past_the_connection_limit_and_dropped_at_the_header_timeout():
    """With 256 open files the server takes 128 connections: 160 slow clients fill it; a
    client past the limit gets a 503 naming it at once (not a refused or hung connection);
    the slow ones are dropped with a 408 after --client-timeout, and then all is served."""
    import resource

    def few_files():
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))

    s = Server("--client-timeout", str(CLIENT_TIMEOUT), preexec_fn=few_files)
    socks = []
    try:
        for _ in range(160):
            socks.append(slow_socket(s.port))
        t0 = time.time()
        try:
            urllib.request.urlopen(s.url + "/health", timeout=10)
            raise AssertionError("a client past the connection limit was served")
        except urllib.error.HTTPError as e:
            assert e.code == 503 and json.loads(e.read())["error"]["code"] == "too_many_connections"
        assert time.time() - t0 < 2
        answers = []
        for sock in socks:  # each dropped after the header timeout, with a 408 (or the refusal)
            data = b""
            while chunk := sock.recv(4096):
                data += chunk
            answers.append(data.split(b" ", 2)[1] if data else b"")
        assert time.time() - t0 < CLIENT_TIMEOUT + 5
        assert answers.count(b"408") >= 100 and set(answers) <= {b"408", b"503"}, set(answers)
        with urllib.request.urlopen(s.url + "/health", timeout=10) as r:
            assert r.status == 200
        status, out = s.post("/v1/completions", {"prompt": "To be", "max_tokens": 2})
        assert status == 200 and out["usage"]["completion_tokens"] == 2
    finally:
        for sock in socks:
            sock.close()
        s.stop()


def answer_until_closed(port: int, request: bytes) -> tuple[bytes, float]:
    """What the server sends for `request` (headers and a part of the body it announces),
    read until the server closes the connection (a socket.timeout after 10 s if it never
    does), and how long that took."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    t0 = time.time()
    try:
        sock.sendall(request)
        answer = b""
        while chunk := sock.recv(4096):
            answer += chunk
        return answer, time.time() - t0
    finally:
        sock.close()


def test_a_response_sent_before_the_body_was_read_closes_the_connection(server):
    """The body's unread rest would hold the connection open with no timer: the answer says
    `connection: close` and the server closes it at once, not after a keep-alive wait."""
    over_limit = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n{" % (64 << 20))
    no_such_path = b"POST /v1/nowhere HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{"
    for request, status in ((over_limit, b"413"), (no_such_path, b"404")):
        answer, took = answer_until_closed(server.port, request)
        head = answer.split(b"\r\n\r\n")[0].lower()
        assert head.startswith(b"http/1.1 " + status) and b"connection: close" in head, answer
        assert took < 3  # (uvicorn's keep-alive timer is 5 s)
    body = b'{"prompt": "To be", "max_tokens": 1}'  # a body read in full keeps its connection
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    for _ in range(2):
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200 and resp.getheader("connection") is None and json.loads(resp.read())["choices"]
    conn.close()


def test_a_stalled_body_gets_408_and_a_client_hanging_up_mid_body_is_one_log_line(server):
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 1000\r\n\r\n" + b'{"prompt": "' + b"a" * 20)
    t0 = time.time()
    answer = b""
    while chunk := sock.recv(4096):  # (the server closes the connection after its answer)
        answer += chunk
    assert answer.startswith(b"HTTP/1.1 408") and b"request_timeout" in answer
    assert CLIENT_TIMEOUT - 0.2 < time.time() - t0 < CLIENT_TIMEOUT + 3
    sock.close()
    before = server.output()
    for _ in range(20):
        sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n" + b"{" * 100)
        time.sleep(0.02)
        sock.close()
    deadline = time.time() + 10
    while server.output()[len(before):].count("hung up") < 20 and time.time() < deadline:
        time.sleep(0.1)
    logged = server.output()[len(before):]
    assert logged.count("hung up while sending its request body") == 20, logged[-2000:]
    assert "Traceback" not in logged and len(logged.strip().splitlines()) == 20, logged[-2000:]
    status, out = server.post("/v1/completions", {"prompt": "To be", "max_tokens": 2})
    assert status == 200


def test_a_client_gone_while_its_prompt_is_prepared_ends_it_without_a_500(monkeypatch):
    """The prompt's job is cancelled when its client hangs up; the request ended in an
    InvalidStateError (a 500 and a traceback in the log for each such client), where it
    ends as a 499 the gone client never reads."""
    import asyncio

    from fastmamba.io.folders import default_model_dir
    from fastmamba.io.prompts import PromptEncoder
    from fastmamba.io.tokenizer import Tokenizer
    from fastmamba.serve import prompt_workers
    from fastmamba.serve.app import create_app
    from fastmamba.serve.options import ServeOptions

    pytest.importorskip("fastapi")
    folder = default_model_dir()
    cancelled = []

    async def slow_encode(self, text, add_special_tokens=True):
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.append(text)
            raise
        return [1]

    monkeypatch.setattr(prompt_workers.PromptWorkers, "__init__", lambda self, *a, **k: None)
    monkeypatch.setattr(prompt_workers.PromptWorkers, "encode", slow_encode)

    class Engine:
        alive, capacity, on_stats = True, None, None

    app = create_app(Engine(), PromptEncoder(Tokenizer(folder / "tokenizer.json"), 50280, folder), ServeOptions())
    body = json.dumps({"prompt": "To be"}).encode()
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/tokenize", "raw_path": b"/tokenize", "root_path": "", "query_string": b"",
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 8000)}
    messages, sent = [], []

    async def receive():
        if not messages:
            messages.append(1)
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.sleep(0.2)
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    asyncio.run(asyncio.wait_for(app(scope, receive, send), 20))
    assert cancelled == ["To be"]
    assert [m["status"] for m in sent if m["type"] == "http.response.start"] == [499]
