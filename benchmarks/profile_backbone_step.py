"""Where a Backbone step's time goes on the GPU: each kernel's GPU time (torch.profiler over
the step's kernels run eagerly, the same kernels the graph replays), the state's copy floor,
and at batch 1 the host's share of a call (the copy in, the replay, the clone out).

    python benchmarks/profile_backbone_step.py --shape 128x3 --batches 1,1024,4096
"""

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from fastmamba import Backbone, BackboneConfig  # noqa: E402
from fastmamba.backbone import KernelStep  # noqa: E402

SHAPES = {"128x3": dict(input_dim=64, d_model=128, n_layer=3), "512x4": dict(input_dim=64, d_model=512, n_layer=4)}


def host_us(fn, reps=2000) -> float:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / reps * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shape", default="128x3", choices=list(SHAPES))
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--batches", default="1,1024,4096")
    args = ap.parse_args()
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    bb = Backbone(BackboneConfig(**SHAPES[args.shape]), device="cuda", dtype=dtype)
    for batch in map(int, args.batches.split(",")):
        state = bb.new_state(batch)
        x = torch.randn(batch, bb.config.input_dim, device="cuda")
        step = KernelStep(bb, batch)
        with torch.no_grad():
            for _ in range(3):
                step(x, state)
            torch.cuda.synchronize()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(10):
                    step(x, state)
                torch.cuda.synchronize()
        print(f"\n== {args.shape} {args.dtype} batch {batch}: GPU time of 10 steps' kernels")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=16, max_name_column_width=48))
        nbytes = sum(t.numel() * t.element_size() for t in (state.conv, state.ssm))
        buf = torch.empty(nbytes // 4, device="cuda")
        out = torch.empty_like(buf)
        copy = host_us(lambda: out.copy_(buf), 200)
        print(f"state {nbytes / 1e6:.1f} MB: read and written by one copy in {copy:.1f} us")
        with torch.no_grad():
            y = bb.step(x, state)
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
        del y


if __name__ == "__main__":
    main()
