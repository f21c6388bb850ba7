"""Serving benchmark: `fastmamba serve`'s HTTP API under load, on loopback.

`fastmamba serve`'s front end (uvicorn in a thread of this process) over its engine process,
on a model with random weights at a public shape (a checkpoint folder written for the run); an asyncio load generator (in processes of its own, so
that it does not share the server's interpreter lock) with streaming clients at each
concurrency, prompts of 64-2048 tokens and outputs of 64-512 drawn from a fixed seed (token
ids: the model has no tokenizer). Per concurrency: output tokens/s, time to first token and
inter-token latency (p50 / p99, and the mean: events that arrive in one write have gaps of
~0), and the same prompts through offline `generate_batch` at that batch for a ratio (the same engine, in this process),
and how many kernels Triton compiled during each (the served level runs first, and the cache
on disk is shared: a kernel the server compiles comes ready to the offline run). Then: 16 clients with 512-token
prompts (time to first token), a shared 2048-token prefix cold and cached, and 300 clients
at once against room for 256 (slots + queue): 429s, no 500s, every accepted stream complete.
Every loop is bounded: a fixed number of requests per level, each with a timeout.

    python -m benchmarks.serve --model 2.8b --json serve.json
"""

import argparse
import asyncio
import json
import os
import random
import socket
import statistics
import tempfile
import threading
import time
from pathlib import Path

import torch

import fastmamba
from fastmamba.bench import time_graph_steps, write_random_checkpoint
from fastmamba.core.kv_cache import bytes_per_token
from fastmamba.core.sampling_params import SamplingParams
from fastmamba.engine.options import EngineOptions
from fastmamba.engine.process import ProcessClient
from fastmamba.io.prompts import PromptEncoder
from fastmamba.serve.app import create_app
from fastmamba.serve.options import ServeOptions


def pct(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


async def one(client, url, prompt, max_tokens):
    """A streaming completion: (ttft s, inter-token gaps, tokens); tokens is -1 on an error,
    and -429 on a 429."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.8, "seed": len(prompt), "stream": True,
            "stop_token_ids": []}
    t0 = time.perf_counter()
    times = []
    async with client.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
        if r.status_code == 429:
            await r.aread()
            return float("nan"), [], -429
        if r.status_code != 200:  # an error body, reported and counted
            print("error:", r.status_code, (await r.aread())[:200], flush=True)
            return float("nan"), [], -1
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    print("error:", chunk["error"], flush=True)
                    return float("nan"), [], -1
                if chunk.get("choices") and chunk["choices"][0]["finish_reason"] is None:
                    times.append(time.perf_counter())
    gaps = [b - a for a, b in zip(times, times[1:])]
    return times[0] - t0, gaps, len(times)


async def level(url, jobs, concurrency):
    import httpx

    limits = httpx.Limits(max_connections=concurrency + 8, max_keepalive_connections=concurrency + 8)
    async with httpx.AsyncClient(limits=limits) as client:
        sem = asyncio.Semaphore(concurrency)

        async def run(job):
            async with sem:
                return await one(client, url, *job)

        t0 = time.perf_counter()
        results = await asyncio.gather(*(run(j) for j in jobs))
        return results, time.perf_counter() - t0


def triton_cache_entries() -> set[Path]:
    """Entries in Triton's on-disk kernel cache, which the engine's process and this one
    share: each kernel compiled adds one, so the entries new over a level say whether (and
    which) kernels were still being compiled while it was timed."""
    path = Path(os.environ.get("TRITON_CACHE_DIR") or Path.home() / ".triton" / "cache")
    return set(path.iterdir()) if path.is_dir() else set()


def kernel_names(entries: set[Path]) -> list[str]:
    """The kernels these cache entries hold (each compiled kernel's metadata file is named
    after it), sorted, a name once per variant compiled."""
    return sorted(f.stem for e in entries for f in e.glob("*.json") if not f.name.startswith("__grp__"))


def start_server(app):
    """uvicorn serving `app` on a free loopback port, in a thread: (server, url)."""
    import uvicorn

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    return server, f"http://127.0.0.1:{port}"


def start_clients(n: int) -> list:
    """n load-generator processes (each a one-worker pool), started before any timing."""
    import concurrent.futures
    import multiprocessing

    spawn = multiprocessing.get_context("spawn")
    clients = [concurrent.futures.ProcessPoolExecutor(1, mp_context=spawn) for _ in range(n)]
    for pool in clients:
        pool.submit(int).result()
    return clients


def client_level(url, jobs, concurrency):
    """level() in a process of its own (the load generator must not share the server's
    interpreter lock): returns (results, wall s)."""
    return asyncio.run(level(url, jobs, concurrency))


def http_level(clients, url, jobs, concurrency):
    """The load split over the client processes, each with its share of the concurrency;
    results in the jobs' order."""
    n = min(len(clients), concurrency)
    shares = [list(range(k, len(jobs), n)) for k in range(n)]
    t0 = time.perf_counter()
    futures = [clients[k].submit(client_level, url, [jobs[i] for i in share], concurrency // n + (k < concurrency % n))
               for k, share in enumerate(shares)]
    results = [None] * len(jobs)
    for share, f in zip(shares, futures):
        for i, r in zip(share, f.result()[0]):
            results[i] = r
    return results, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="2.8b", help="a shape of fastmamba.bench's SHAPES or HYBRID_SHAPES")
    ap.add_argument("--levels", default="1,16,64,256")
    ap.add_argument("--requests", type=int, default=2, help="requests per level, as a multiple of its concurrency")
    ap.add_argument("--prompts", default="64,2048", help="prompt lengths drawn from this range")
    ap.add_argument("--outputs", default="64,512", help="output lengths drawn from this range")
    ap.add_argument("--clients", type=int, default=4, help="load generator processes")
    ap.add_argument("--prefill-tokens", type=int, default=4096, help="the engine's prefill budget a step (serve's default)")
    ap.add_argument("--cpu", action="store_true", help="a smoke run on the CPU's reference engine (use a small --model)")
    ap.add_argument("--json")
    args = ap.parse_args()
    levels = [int(x) for x in args.levels.split(",")]
    prompts, outputs = ([int(x) for x in a.split(",")] for a in (args.prompts, args.outputs))
    dtype, device = (torch.float32, "cpu") if args.cpu else (torch.bfloat16, "cuda")
    folder = Path(tempfile.mkdtemp(prefix="fastmamba-bench-")) / args.model
    write_random_checkpoint(args.model, folder, dtype)
    slots = max(levels + [16])  # the 16-client TTFT workload too
    lm = fastmamba.load(folder, device=device, dtype=dtype)  # offline: the same engine in this process
    V = lm.config.vocab_size
    # A hybrid's KV cache: what the workload's longest requests need in every slot, not half
    # the free memory, which left the offline engine beside it no room for its own
    kv_mb = None
    if getattr(lm.config, "n_attention", 0):
        per_token = bytes_per_token(lm.config, lm.model.weights.embedding.element_size())
        kv_mb = -(-slots * (prompts[1] + outputs[1] + 1024) * per_token >> 20)
    options = ServeOptions(engine=EngineOptions(model=str(folder), device=device, dtype=str(dtype).removeprefix("torch."),
                                                max_batch=slots, prefill_tokens=args.prefill_tokens, kv_cache_mb=kv_mb),
                           served_model_name=args.model, max_queue=10 * slots)
    t0 = time.perf_counter()
    engine = ProcessClient(options.engine, folder, max_queue=options.max_queue)
    print(f"engine process ready (graphs captured) in {time.perf_counter() - t0:.1f} s", flush=True)
    server, url = start_server(create_app(engine, PromptEncoder(None, V), options))
    clients = start_clients(args.clients)

    def run_level(jobs, c):
        return http_level(clients, url, jobs, c)
    rng = random.Random(0)
    rows = []
    device = "CPU" if args.cpu else torch.cuda.get_device_name()
    print(f"device: {device}, model {args.model} {lm.model.weights.embedding.dtype} (random weights), HTTP")
    for c in levels:
        n = max(16, args.requests * c) if c > 1 else 8
        jobs = [([rng.randrange(1, V) for _ in range(rng.randint(*prompts))], rng.randint(*outputs)) for _ in range(n)]
        cached = triton_cache_entries()
        results, wall = run_level(jobs, c)
        compiled_served = triton_cache_entries() - cached
        if compiled_served:  # (a kernel compiled inside the timed level: a request waited for it)
            print(f"compiled while served: {', '.join(kernel_names(compiled_served))}", flush=True)
        # no stop tokens: every request must bring exactly its max_tokens
        lost = sum(r[2] != m for r, (_, m) in zip(results, jobs))
        tokens = sum(max(r[2], 0) for r in results)
        if tokens == 0:
            raise SystemExit(f"concurrency {c}: none of the {n} requests brought a token (the errors above say why)")
        ttft = [r[0] for r in results if r[2] > 0]
        # the decode step alone at this batch (graph-replayed, sampling included): the
        # inter-token latency's yardstick
        # (a hybrid's step replays with its KV cache in the engine only: no yardstick here)
        hybrid = lm.model.config.family != "mamba"
        step_ms = float("nan") if args.cpu or hybrid else time_graph_steps(lm.model, c, params=SamplingParams(temperature=0.8))
        gaps = [g for r in results for g in r[1]]
        # offline: the same prompts through generate_batch, `c` at a time
        t0 = time.perf_counter()
        for i in range(0, len(jobs), c):
            batch = jobs[i : i + c]
            lm.generate_batch([p for p, _ in batch], [SamplingParams(max_tokens=m, temperature=0.8, seed=len(p), stop_token_ids=[])
                                                    for p, m in batch])
        if not args.cpu:
            torch.cuda.synchronize()
        offline = tokens / (time.perf_counter() - t0)
        compiled_offline = triton_cache_entries() - cached - compiled_served
        row = dict(concurrency=c, requests=n, prefill_tokens=args.prefill_tokens, output_tokens_per_s=round(tokens / wall), offline_tokens_per_s=round(offline),
                   ratio=round(tokens / wall / offline, 3), ttft_p50_ms=round(pct(ttft, 0.5) * 1e3, 1),
                   ttft_p99_ms=round(pct(ttft, 0.99) * 1e3, 1), itl_p50_ms=round(pct(gaps, 0.5) * 1e3, 2),
                   itl_p99_ms=round(pct(gaps, 0.99) * 1e3, 2), itl_mean_ms=round(statistics.mean(gaps) * 1e3, 2) if gaps else None,
                   step_ms=round(step_ms, 2),
                   itl_p50_over_step=round(pct(gaps, 0.5) * 1e3 / step_ms, 2), lost_or_failed=lost,
                   kernels_compiled_served=len(compiled_served), kernels_compiled_offline=len(compiled_offline))
        rows.append(row)
        print(json.dumps(row), flush=True)
    # 16 clients with 512-token prompts (the TTFT target's workload)
    jobs = [([rng.randrange(1, V) for _ in range(512)], 64) for _ in range(32)]
    results, _ = run_level(jobs, 16)
    row = dict(workload="16 concurrent, 512-token prompts", ttft_p50_ms=round(pct([r[0] for r in results], 0.5) * 1e3, 1))
    rows.append(row)
    print(json.dumps(row), flush=True)
    # shared prefix: the first request prefills 2048 tokens, the next resume from the cache
    prefix = [rng.randrange(1, V) for _ in range(2048)]
    cold = run_level([(prefix + [rng.randrange(1, V) for _ in range(16)], 16)], 1)[0][0][0]
    hits = run_level([(prefix + [rng.randrange(1, V) for _ in range(16)], 16) for _ in range(8)], 1)[0]
    hot = statistics.median(r[0] for r in hits)
    row = dict(workload="shared 2048-token prefix", ttft_cold_ms=round(cold * 1e3, 1), ttft_hit_ms=round(hot * 1e3, 1),
               speedup=round(cold / hot, 1))
    rows.append(row)
    print(json.dumps(row), flush=True)
    # 300 clients at once against room for 256 requests (slots + queue): the rest get 429s
    engine.max_queue = 256 - engine.max_batch
    jobs = [([rng.randrange(1, V) for _ in range(rng.randint(64, 512))], 64) for _ in range(300)]
    results, _ = run_level(jobs, 300)
    refused = sum(r[2] == -429 for r in results)
    complete = sum(r[2] == m for r, (_, m) in zip(results, jobs))
    row = dict(workload="300 clients, room for 256", accepted_complete=complete, refused_429=refused,
               other=len(jobs) - complete - refused, server_up=engine.alive)
    rows.append(row)
    print(json.dumps(row), flush=True)
    server.should_exit = True
    engine.shutdown()
    if args.json:
        Path(args.json).write_text(json.dumps(dict(device=device, model=args.model, rows=rows), indent=2))


if __name__ == "__main__":
    main()
