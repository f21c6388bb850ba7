"""Per-kernel GPU time of one decode step (torch.profiler), to see where a step's time goes.
With --backbone DxL: fastmamba.Backbone's step (d_model D, n_layer L, input_dim 64) at each
of --batches, its kernels run eagerly (the same the graph replays), the state's copy time,
and the host's share of a call (the copy in, the replay, the clone out), timed back to back.

    python benchmarks/profile_step.py --model 2.8b --batch 1
    python benchmarks/profile_step.py --model mamba2-2.7b --batch 1 --step one-row
    python benchmarks/profile_step.py --backbone 128x3 --dtype float32 --batches 1,1024,4096
"""

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from fastmamba.bench import random_model  # noqa: E402
from fastmamba.core.dtypes import parse_dtype  # noqa: E402
from fastmamba.engine.plan import DecodePlan  # noqa: E402
from fastmamba.engine.decode_step import make_decode_step  # noqa: E402


def print_kernel_times(step, title: str, warm: int = 3, steps: int = 5, rows: int = 14) -> None:
    """torch.profiler's table of the GPU kernels of `steps` calls of step() (after `warm`)."""
    for _ in range(warm):
        step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    print(f"{title}: GPU time of {steps} steps' kernels")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=rows, max_name_column_width=50))


def host_us(fn, reps: int) -> float:
    """µs a call of fn, called back to back (the host's time where it exceeds the GPU's)."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / reps * 1e6


def profile_backbone(shape: str, dtype: torch.dtype, batches: list[int]) -> None:
    from fastmamba import Backbone, BackboneConfig
    from fastmamba.engine.backbone import KernelStep

    d_model, n_layer = map(int, shape.split("x"))
    torch.manual_seed(0)
    bb = Backbone(BackboneConfig(input_dim=64, d_model=d_model, n_layer=n_layer), device="cuda", dtype=dtype)
    for batch in batches:
        state = bb.new_state(batch)
        x = torch.randn(batch, bb.config.input_dim, device="cuda")
        step = KernelStep(bb, batch)
        with torch.no_grad():
            print_kernel_times(lambda: step(x, state), f"\n== backbone {shape} {dtype} batch {batch}", steps=10, rows=16)
        nbytes = sum(t.numel() * t.element_size() for t in (state.conv, state.ssm))
        buf = torch.empty(nbytes // 4, device="cuda")
        out = torch.empty_like(buf)
        print(f"state {nbytes / 1e6:.1f} MB: read and written by one copy in {host_us(lambda: out.copy_(buf), 200):.1f} us")
        bb.step(x, state)
        g = bb._last_graph
        parts = {
            "public step": lambda: bb.step(x, state),
            "replay alone": g.device_graph.replay,
            "copy in": lambda: g.x.copy_(x),
            "clone out": lambda: g.y.clone(),
            "A_log check": g.kernels.sync,
            "copy + replay + clone": lambda: (g.x.copy_(x), g.device_graph.replay(), g.y.clone()),
        }
        for name, fn in parts.items():
            print(f"  {name}: {host_us(fn, 500 if batch > 256 else 2000):.1f} us a call")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="2.8b")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--deterministic", action="store_true", help="the batch-invariant step")
    ap.add_argument("--step", choices=("one-row", "products", "layer-ops"),
                    help="this step (decode_plan.DecodePlan's default settings) in place of the plan table's")
    ap.add_argument("--backbone", metavar="DxL", help="a Backbone's step instead of a language model's")
    ap.add_argument("--batches", default="1,1024,4096", help="with --backbone")
    args = ap.parse_args()
    if args.backbone:
        profile_backbone(args.backbone, parse_dtype(args.dtype), [int(b) for b in args.batches.split(",")])
        return
    model = random_model(args.model, parse_dtype(args.dtype))
    plan = DecodePlan(args.step) if args.step else None  # (None: the step the engine would run)
    step = make_decode_step(model, args.batch, args.deterministic, plan)
    state = model.new_state(args.batch)
    tokens = torch.zeros(args.batch, dtype=torch.int64, device="cuda")
    print_kernel_times(lambda: step(tokens, state), f"{args.model} {args.dtype} batch {args.batch}")


if __name__ == "__main__":
    main()
