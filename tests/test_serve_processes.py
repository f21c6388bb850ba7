"""`fastmamba serve`'s processes: the engine ends with its front end however the front end
dies, a wedged engine shows on /health and ends its requests with 503s, the socket folder
never outlives the server, and a bad --model folder is one line. A real server subprocess
on a loopback port; every loop is bounded in count and time."""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
from test_server import Server, engine_pid, free_port, running

pytest.importorskip("fastapi")


def children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(p) for p in f.read().split()]


def ended(pid: int) -> bool:
    """Whether the process is gone (or a zombie, ended and not yet reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def wait_until(predicate, seconds: float, what: str) -> float:
    """Seconds it took; an AssertionError naming `what` past `seconds`."""
    t0 = time.time()
    while not predicate():
        assert time.time() - t0 < seconds, f"{what} did not happen in {seconds} s"
        time.sleep(0.05)
    return time.time() - t0


def stream(port: int, max_tokens: int = 10**4) -> http.client.HTTPResponse:
    """A streaming completion that runs long (no stop token), its first chunk read."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    body = {"prompt": "To be", "max_tokens": max_tokens, "temperature": 0, "stop_token_ids": [], "stream": True}
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.read1(100)
    return resp


def health(url: str) -> int:
    try:
        with urllib.request.urlopen(url + "/health", timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def test_a_front_end_killed_mid_stream_leaves_no_engine_and_no_socket_folder(tmp_path):
    """SIGKILL of the front end while a stream runs: the engine (busy, its socket full of
    outputs for a dead peer) and the prompt workers end within seconds. The socket folder
    went as soon as the engine was connected: no way both processes end can leave it."""
    s = Server("--max-model-len", "20000", env={"TMPDIR": str(tmp_path)})
    try:
        resp = stream(s.port)
        engine = engine_pid(s.proc.pid)
        others = children(s.proc.pid)
        assert engine in others and not list(tmp_path.glob("fastmamba-*"))
        s.proc.send_signal(signal.SIGKILL)
        s.proc.wait(timeout=30)
        took = wait_until(lambda: all(ended(p) for p in others), 10, "the engine and workers ending")
        assert took < 5 and not list(tmp_path.glob("fastmamba-*"))
        resp.close()
    finally:
        s.stop()


WATCHED = """
import multiprocessing, sys, time
from fastmamba.engine.process import exit_with_parent

def child(folder):
    exit_with_parent(remove=(folder,))
    time.sleep(60)

if __name__ == "__main__":
    c = multiprocessing.get_context("spawn").Process(target=child, args=(sys.argv[1],))
    c.start()
    print(c.pid, flush=True)
    time.sleep(60)
"""


def test_a_spawned_process_ends_and_removes_its_folder_when_its_parent_is_killed(tmp_path):
    """The engine's watch on its parent (in force while it loads, before the front end has
    removed the socket folder itself): SIGKILL of the parent ends the child at once, and the
    child removes the folder."""
    folder = tmp_path / "fastmamba-sockets"
    folder.mkdir()
    (folder / "to-engine").write_text("")
    script = tmp_path / "watched.py"
    script.write_text(WATCHED)
    parent = subprocess.Popen([sys.executable, str(script), str(folder)], stdout=subprocess.PIPE, text=True)
    try:
        child = int(parent.stdout.readline())
        time.sleep(0.5)  # (the child's watch is up)
        assert not ended(child) and folder.exists()
        parent.kill()
        parent.wait(timeout=10)
        assert wait_until(lambda: ended(child) and not folder.exists(), 5, "the child ending") < 2
    finally:
        parent.kill()


def test_a_stopped_engine_turns_health_503_and_ends_its_requests_until_it_answers_again():
    """SIGSTOP of the engine: within --engine-timeout (and a heartbeat), the open stream ends
    with a 503 error event, /health says 503 and a new request gets a 503 at once; after
    SIGCONT the engine answers again and serves."""
    s = Server("--max-model-len", "20000", "--engine-timeout", "2")
    engine = engine_pid(s.proc.pid)
    try:
        resp = stream(s.port)
        os.kill(engine, signal.SIGSTOP)
        t0 = time.time()
        tail = resp.read().decode()  # the stream ends: its error event, then [DONE]
        assert time.time() - t0 < 2 + 3
        assert "engine_unavailable" in tail and tail.endswith("data: [DONE]\n\n"), tail[-300:]
        assert health(s.url) == 503
        assert running(s) == 0  # (not the engine's last stats, the stream's slot in them)
        assert "fastmamba: the engine process has not answered for over 2 s" in s.output()
        t1 = time.time()
        status, body = s.post("/v1/completions", {"prompt": "To be", "max_tokens": 3})
        assert status == 503 and body["error"]["code"] == "engine_unavailable"
        assert "has not answered" in body["error"]["message"]
        assert time.time() - t1 < 1
        os.kill(engine, signal.SIGCONT)
        wait_until(lambda: health(s.url) == 200, 5, "/health back to 200")
        out = s.client().completions.create(model=s.client().models.list().data[0].id, prompt="To be", max_tokens=3)
        assert out.usage.completion_tokens == 3
        wait_until(lambda: running(s) == 0, 10, "the failed stream's slot freed")  # (it was aborted, not run on)
    finally:
        try:
            os.kill(engine, signal.SIGCONT)
        except ProcessLookupError:
            pass
        s.stop()


def serve_error(*flags: str) -> str:
    """`fastmamba serve ...` that must fail at once: its one line of error."""
    r = subprocess.run([sys.executable, "-m", "fastmamba.cli", "serve", "--port", str(free_port()), *flags],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    return lines[0]


def test_a_missing_model_folder_or_a_file_is_one_line_saying_so(tmp_path):
    missing = tmp_path / "no-such-model"
    line = serve_error("--model", str(missing))
    assert "does not exist" in line and str(missing) in line
    a_file = tmp_path / "weights.bin"
    a_file.write_bytes(b"\0")
    line = serve_error("--model", str(a_file))
    assert "is a file" in line and str(a_file) in line
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "no tokenizer.json" in serve_error("--model", str(empty))


def test_an_empty_api_key_and_replicas_beside_autoscale_are_one_line_each():
    """(an empty --api-key, from an unset variable, turned authentication off; --replicas was
    dropped without a word beside --autoscale)"""
    assert "--api-key is empty" in serve_error("--api-key", "")
    assert "takes the place of --replicas" in serve_error("--replicas", "2", "--autoscale", "1:2")
