"""A bounded soak of `fastmamba serve`: mixed traffic for --minutes against a model with random
weights at a public shape, the server started as users start it (`fastmamba serve`, its engine
in a process of its own), on loopback.

The traffic, from --clients concurrent workers, each request drawn from a fixed seed:
  stream    streamed completions of token-id prompts (16-1536 tokens, 16-256 out, no stop
            tokens): each must bring exactly its max_tokens
  cancel    the same, the client hanging up after a few tokens
  chat      non-streamed chat (text through the tokenizer and the template)
  large     a text prompt of 2-6 MB to /tokenize or to completions (over --max-model-len: a 400)
  bad       client mistakes: broken JSON, 50,000-deep JSON, a prompt that is a number, a
            negative max_tokens, an unknown model, a content part that is null, a prompt over
            the length limit: each must be a 4xx carrying a message
and a probe of /health once a second (its latency: the event loop's freedom).

Every --sample seconds: the GPU's used memory (nvidia-smi), the server's host memory (the
resident set of its processes), requests by outcome, tokens a second, /health's worst
latency. The verdict: no request lost, no 5xx but a 503 with a reason, memory after warm-up
(the first --warmup minutes) flat, and the server's processes gone within seconds of SIGTERM.

    python -m benchmarks.soak --model 2.8b --minutes 20 --json soak.json
    python -m benchmarks.soak --model 130m --cpu --minutes 1 --clients 4   # a smoke run
"""

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch

from fastmamba.bench import write_random_checkpoint


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def descendants(pid: int) -> list[int]:
    """pid and every process below it (from /proc's parent links)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def rss_mb(pids: list[int]) -> float:
    total = 0
    for p in pids:
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except OSError:
            pass
    return total / 1024


def alive(pid: int) -> bool:
    """Whether pid is a process that has not ended (a zombie has)."""
    try:
        return "zombie" not in Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False


def gpu_used_mb() -> float | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10).stdout
        return float(out.split()[0])
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
        return None


class Tally:
    def __init__(self):
        self.outcomes: Counter = Counter()
        self.tokens = 0
        self.problems: list[str] = []  # (the first few of each kind, for the report)
        self.health_worst = 0.0

    def problem(self, text: str) -> None:
        self.outcomes["problem"] += 1
        if len(self.problems) < 20:
            self.problems.append(text)
            print("PROBLEM:", text, flush=True)


def has_reason(body: bytes) -> bool:
    try:
        return bool(json.loads(body)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return False


async def expect_refusal(client, tally: Tally, kind: str, method: str, path: str, **kw) -> None:
    """A client mistake: a 4xx (429 included) or a 503, with an error message."""
    r = await client.request(method, path, **kw)
    if 400 <= r.status_code < 500 or r.status_code == 503:
        if has_reason(r.content):
            tally.outcomes[f"{kind} {r.status_code}"] += 1
        else:
            tally.problem(f"{kind}: {r.status_code} without a message: {r.content[:200]!r}")
    else:
        tally.problem(f"{kind}: status {r.status_code} for a client mistake: {r.content[:200]!r}")


async def stream(client, tally: Tally, rng: random.Random, V: int, max_len: int, cancel: bool) -> None:
    n_prompt = rng.randint(16, 1536)
    max_tokens = min(rng.randint(16, 256), max_len - n_prompt)
    body = {"prompt": [rng.randrange(3, V) for _ in range(n_prompt)], "max_tokens": max_tokens, "stream": True,
            "temperature": 0.8, "seed": rng.randrange(1 << 30), "stop_token_ids": []}
    hang_up = rng.randint(1, 12) if cancel else None
    got = 0
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code in (429, 503):
            body = await r.aread()
            if has_reason(body):
                tally.outcomes[f"stream {r.status_code}"] += 1
            else:
                tally.problem(f"stream: {r.status_code} without a message")
            return
        if r.status_code != 200:
            tally.problem(f"stream: status {r.status_code}: {(await r.aread())[:200]!r}")
            return
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                tally.problem(f"stream: error event {chunk['error']}")
                return
            if chunk.get("choices") and chunk["choices"][0]["finish_reason"] is None:
                got += 1
                tally.tokens += 1
                if hang_up is not None and got >= hang_up:
                    tally.outcomes["cancelled"] += 1
                    return  # (leaving the block closes the connection mid-stream)
    if got == max_tokens or (cancel and got < hang_up):
        tally.outcomes["stream ok" if not cancel else "cancel finished first"] += 1
    else:
        tally.problem(f"stream: {got} tokens of {max_tokens} (lost)")


async def chat(client, tally: Tally, rng: random.Random) -> None:
    words = " ".join(rng.choice(["soak", "mamba", "state", "token", "river", "stone"]) for _ in range(rng.randint(5, 400)))
    max_tokens = rng.randint(4, 64)
    r = await client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": words}], "max_tokens": max_tokens, "temperature": 0.7})
    if r.status_code == 200:
        usage = r.json()["usage"]
        if 1 <= usage["completion_tokens"] <= max_tokens:
            tally.outcomes["chat ok"] += 1
            tally.tokens += usage["completion_tokens"]
        else:
            tally.problem(f"chat: usage {usage} for max_tokens {max_tokens}")
    elif r.status_code in (429, 503) and has_reason(r.content):
        tally.outcomes[f"chat {r.status_code}"] += 1
    else:
        tally.problem(f"chat: status {r.status_code}: {r.content[:200]!r}")


async def large(client, tally: Tally, rng: random.Random) -> None:
    text = "stone river " * (rng.randint(2, 6) * 2**20 // 12)
    if rng.random() < 0.5:
        r = await client.post("/tokenize", json={"prompt": text})
        if r.status_code == 200 and len(r.json()["tokens"]) > 100_000:
            tally.outcomes["large tokenize ok"] += 1
        elif r.status_code in (413, 429, 503) and has_reason(r.content):
            tally.outcomes[f"large tokenize {r.status_code}"] += 1
        else:
            tally.problem(f"large tokenize: status {r.status_code}: {r.content[:200]!r}")
    else:
        await expect_refusal(client, tally, "large prompt", "POST", "/v1/completions",
                             json={"prompt": text, "max_tokens": 4})


BAD = [
    ("broken json", lambda V, L: dict(content=b'{"prompt": [1, 2', headers={"content-type": "application/json"})),
    ("deep json", lambda V, L: dict(content=b'{"prompt": ' + b"[" * 50_000 + b"]" * 50_000 + b"}",
                                    headers={"content-type": "application/json"})),
    ("number prompt", lambda V, L: dict(json={"prompt": 5, "max_tokens": 4})),
    ("negative max_tokens", lambda V, L: dict(json={"prompt": [5, 6], "max_tokens": -1})),
    ("huge integer", lambda V, L: dict(content=b'{"prompt": [1], "max_tokens": ' + b"9" * 5000 + b"}",
                                       headers={"content-type": "application/json"})),
    ("token id over the vocabulary", lambda V, L: dict(json={"prompt": [V + 7], "max_tokens": 4})),
    ("over max-model-len", lambda V, L: dict(json={"prompt": [5] * L, "max_tokens": 4})),
    ("unknown model", lambda V, L: dict(json={"model": "no-such-model", "prompt": [5], "max_tokens": 4})),
]
BAD_CHAT = [
    ("null content part", {"messages": [{"role": "user", "content": [{"type": "text", "text": None}]}]}),
    ("no messages", {"messages": []}),
]


async def bad(client, tally: Tally, rng: random.Random, V: int, max_len: int) -> None:
    if rng.random() < 0.8:
        name, make = rng.choice(BAD)
        await expect_refusal(client, tally, "bad: " + name, "POST", "/v1/completions", **make(V, max_len))
    else:
        name, body = rng.choice(BAD_CHAT)
        await expect_refusal(client, tally, "bad: " + name, "POST", "/v1/chat/completions", json=body)


KINDS = [("stream", 45), ("cancel", 15), ("chat", 12), ("bad", 20), ("large", 8)]


async def worker(k: int, url: str, tally: Tally, until: float, V: int, max_len: int) -> None:
    import httpx

    rng = random.Random(k)
    names, weights = zip(*KINDS)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(120)) as client:
        while time.monotonic() < until:
            kind = rng.choices(names, weights)[0]
            try:
                if kind in ("stream", "cancel"):
                    await stream(client, tally, rng, V, max_len, kind == "cancel")
                elif kind == "chat":
                    await chat(client, tally, rng)
                elif kind == "large":
                    await large(client, tally, rng)
                else:
                    await bad(client, tally, rng, V, max_len)
            except httpx.HTTPError as e:
                tally.problem(f"{kind}: {type(e).__name__}: {e}")


async def health_probe(url: str, tally: Tally, until: float) -> None:
    import httpx

    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(60)) as client:
        while time.monotonic() < until:
            t = time.perf_counter()
            r = await client.get("/health")
            tally.health_worst = max(tally.health_worst, time.perf_counter() - t)
            if r.status_code != 200:
                tally.problem(f"/health: {r.status_code} {r.content[:200]!r}")
            await asyncio.sleep(1)


async def soak(url: str, server_pid: int, args, V: int) -> list[dict]:
    tally = Tally()
    t0 = time.monotonic()
    until = t0 + args.minutes * 60
    tasks = [asyncio.create_task(worker(k, url, tally, until, V, args.max_model_len)) for k in range(args.clients)]
    tasks.append(asyncio.create_task(health_probe(url, tally, until)))
    samples, last_tokens = [], 0
    partial = Path(args.json).with_suffix(".partial.json") if args.json else None
    while time.monotonic() < until:
        await asyncio.sleep(min(args.sample, max(0.0, until - time.monotonic())))
        tokens, last_tokens = tally.tokens - last_tokens, tally.tokens
        sample = dict(minute=round((time.monotonic() - t0) / 60, 2), gpu_used_mb=gpu_used_mb(),
                      server_rss_mb=round(rss_mb(descendants(server_pid))), tokens_per_s=round(tokens / args.sample),
                      health_worst_ms=round(tally.health_worst * 1e3, 1), outcomes=dict(tally.outcomes))
        tally.health_worst = 0.0
        samples.append(sample)
        print(json.dumps(sample), flush=True)
        if partial:  # (what a run cut short still leaves)
            partial.write_text(json.dumps(dict(samples=samples, problems=tally.problems), indent=1))
    await asyncio.gather(*tasks)
    samples.append(dict(problems=tally.problems, outcomes=dict(tally.outcomes)))
    return samples


def verdict(samples: list[dict], warmup: float) -> dict:
    rows, final = samples[:-1], samples[-1]
    after = [s for s in rows if s["minute"] >= warmup] or rows[-1:]

    def spread(key):
        values = [s[key] for s in after if s[key] is not None]
        return round(max(values) - min(values), 1) if values else None

    return dict(problems=final["outcomes"].get("problem", 0), gpu_mb_spread_after_warmup=spread("gpu_used_mb"),
                host_mb_spread_after_warmup=spread("server_rss_mb"),
                health_worst_ms=max(s["health_worst_ms"] for s in rows), outcomes=final["outcomes"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="2.8b")
    ap.add_argument("--minutes", type=float, default=20)
    ap.add_argument("--warmup", type=float, default=2, help="minutes before memory must be flat")
    ap.add_argument("--clients", type=int, default=48)
    ap.add_argument("--sample", type=float, default=15, help="seconds between samples")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--cpu", action="store_true", help="a smoke run on the CPU's reference engine (a small --model)")
    ap.add_argument("--json")
    args = ap.parse_args()
    dtype = "float32" if args.cpu else "bfloat16"
    folder = Path(tempfile.mkdtemp(prefix="fastmamba-soak-")) / args.model
    t = time.monotonic()
    write_random_checkpoint(args.model, folder, getattr(torch, dtype))
    print(f"checkpoint written in {time.monotonic() - t:.0f} s", flush=True)
    V = json.loads((folder / "config.json").read_text())["vocab_size"]
    port = free_port()
    cmd = [sys.executable, "-m", "fastmamba.cli", "serve", "--model", str(folder), "--port", str(port),
           "--dtype", dtype, "--device", "cpu" if args.cpu else "cuda", "--max-batch", str(max(8, args.clients)),
           "--max-model-len", str(args.max_model_len)]
    log = open(Path(args.json).with_suffix(".serve.log") if args.json else os.devnull, "w")
    # (its own session and output: a soak cut short must not leave it holding this one's pipe)
    server = subprocess.Popen(cmd, start_new_session=True, stdout=log, stderr=subprocess.STDOUT)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("soak: terminated"))
    try:
        run(args, server, port, V)
    finally:
        try:  # (the server and its engine: one process group)
            os.killpg(server.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def run(args, server: subprocess.Popen, port: int, V: int) -> None:
    url = f"http://127.0.0.1:{port}"
    import httpx

    t = time.monotonic()
    while True:  # (bounded: the server's start, graphs captured)
        if server.poll() is not None:
            sys.exit(f"the server exited with {server.returncode} before it was ready")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if time.monotonic() - t > 600:
            server.kill()
            sys.exit("the server was not ready within 600 s")
        time.sleep(1)
    print(f"server ready in {time.monotonic() - t:.0f} s", flush=True)
    samples = asyncio.run(soak(url, server.pid, args, V))
    pids = descendants(server.pid)
    t = time.monotonic()
    server.send_signal(signal.SIGTERM)
    try:
        server.wait(timeout=60)
    except subprocess.TimeoutExpired:
        pass
    while any(map(alive, pids)) and time.monotonic() - t < 60:
        time.sleep(0.2)
    left = [p for p in pids if alive(p)]
    result = dict(device="CPU" if args.cpu else torch.cuda.get_device_name(), model=args.model, minutes=args.minutes,
                  clients=args.clients, verdict=verdict(samples, args.warmup),
                  exit_s=round(time.monotonic() - t, 1), processes_left=len(left), samples=samples[:-1],
                  problems=samples[-1]["problems"])
    for p in left:
        os.kill(p, signal.SIGKILL)
    print(json.dumps({k: v for k, v in result.items() if k != "samples"}, indent=1), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
