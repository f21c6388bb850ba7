"""The engine's step ahead on the GPU, measured: does the GPU idle while the host handles a
step's tokens?

For each model and stream count: the engine core (engine/engine_core.py) in this process, with random
weights, `--streams` requests decoding together (no stop tokens). It times the engine's
steps (wall ms a step, many steps) beside the decode step alone (the graph replayed
back to back, sampling included: `fastmamba bench`'s measure), and records a torch
profiler trace of `--steps` engine steps, from which it reports the fraction of the
window in which a kernel ran (the union of the kernels' intervals over the window). A
Chrome trace per case is written to --out.

Then the offline path through the same engine: `generate` at batch 1 and `generate_batch`
at --streams, ms a token, beside the decode step alone.

    python -m benchmarks.engine_timeline --models 130m,2.8b --streams 1,64 --out timeline
"""

import argparse
import json
import time
from pathlib import Path

import torch

from fastmamba.bench import random_language_model, time_graph_steps
from fastmamba.core.sampling_params import SamplingParams
from fastmamba.engine.engine_core import EngineCore
from fastmamba.engine.protocol import Request


def busy_fraction(prof, t0_us: float, t1_us: float) -> float:
    """The share of [t0, t1] (µs, the profiler's clock) in which some GPU kernel ran."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > t0_us
                   and e.time_range.start < t1_us)
    busy, end = 0.0, t0_us
    for a, b in spans:
        a, b = max(a, end, t0_us), min(b, t1_us)
        if b > a:
            busy += b - a
            end = b
    return busy / (t1_us - t0_us)


def engine_case(lm, streams: int, steps: int, trace: Path | None) -> dict:
    V = lm.config.vocab_size
    core = EngineCore(lm.model, lm.prefill, max_batch=streams, prefill_tokens=4096)
    g = torch.Generator().manual_seed(0)
    for k in range(streams):
        ids = torch.randint(1, V, (64,), generator=g).tolist()
        core.add(Request(k, ids, SamplingParams(max_tokens=100_000, temperature=0.8, seed=k, stop_token_ids=[])))
    for _ in range(20):  # admitted, prefilled, decoding
        core.step()
    assert core.running == streams
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    n = 200
    for _ in range(n):
        core.step()
    torch.cuda.synchronize()
    step_ms = (time.perf_counter() - t0) / n * 1e3
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        with torch.profiler.record_function("window"):
            for _ in range(steps):
                core.step()
            torch.cuda.synchronize()
    window = next(e for e in prof.events() if e.name == "window")
    busy = busy_fraction(prof, window.time_range.start, window.time_range.end)
    if trace is not None:
        prof.export_chrome_trace(str(trace))
    for r in list(core.requests.values()):
        core.abort(r.rid)
    while core.has_work:
        core.step()
    return dict(engine_step_ms=round(step_ms, 3), gpu_busy=round(busy, 3))


def offline_case(lm, streams: int) -> dict:
    V = lm.config.vocab_size
    tokens = 256
    prompts = [torch.randint(1, V, (64,)).tolist() for _ in range(streams)]
    params = SamplingParams(max_tokens=tokens, temperature=0.8, seed=1, stop_token_ids=[])
    lm.generate_batch(prompts, params)  # warm: graphs captured
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    lm.generate_batch(prompts, params)
    torch.cuda.synchronize()
    return dict(generate_ms_per_step=round((time.perf_counter() - t0) / tokens * 1e3, 3))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--models", default="130m,2.8b")
    ap.add_argument("--streams", default="1,64")
    ap.add_argument("--steps", type=int, default=30, help="engine steps in each profiled window")
    ap.add_argument("--out", default="timeline", help="folder for the traces and results.json")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for size in args.models.split(","):
        lm = random_language_model(size, torch.bfloat16)
        for streams in (int(s) for s in args.streams.split(",")):
            row = dict(model=size, streams=streams,
                       graph_step_ms=round(time_graph_steps(lm.model, streams, params=SamplingParams(temperature=0.8)), 3))
            trace = out / f"trace_{size}_{streams}.json" if streams == max(int(s) for s in args.streams.split(",")) else None
            row.update(engine_case(lm, streams, args.steps, trace))
            row.update(offline_case(lm, streams))
            row["engine_over_graph"] = round(row["engine_step_ms"] / row["graph_step_ms"], 3)
            rows.append(row)
            print(json.dumps(row), flush=True)
        del lm
        torch.cuda.empty_cache()
    (out / "results.json").write_text(json.dumps(dict(device=torch.cuda.get_device_name(), rows=rows), indent=2))


if __name__ == "__main__":
    main()
