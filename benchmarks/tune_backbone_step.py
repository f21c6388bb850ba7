"""Sweeps the fused backbone step's launch settings (decode_plan.BackboneStepBlocks) against
the language model's decode kernels (backbone.KernelStep), for decode_plan.BACKBONE_STEP_ROUTES.

Each candidate runs 10 steps captured in one CUDA graph, replayed: the GPU's time a step,
with no host work between steps (what the step costs the device; `benchmarks/backbone.py`
times the public call). The floor beside it: the state read and written once a step at
the copy rate. Prints the best few per (shape, weight dtype, batch) and writes JSON.

    python benchmarks/tune_backbone_step.py --json tune.json [--quick]
"""

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from fastmamba import Backbone, BackboneConfig  # noqa: E402
from fastmamba.backbone import KernelStep  # noqa: E402
from fastmamba.cuda_graphs import capture_graph  # noqa: E402
from fastmamba.decode_plan import BackboneStepBlocks  # noqa: E402
from fastmamba.kernels.backbone_step import FusedBackboneStep  # noqa: E402

SHAPES = {"128x3": dict(input_dim=64, d_model=128, n_layer=3), "512x4": dict(input_dim=64, d_model=512, n_layer=4)}
STEPS = 10  # steps a graph


def gpu_us(run, x, state, reps=20) -> float:
    """µs a step of `run` replayed STEPS to a graph (the state restored after)."""
    saved = (state.conv.clone(), state.ssm.clone())

    def body():
        for _ in range(STEPS):
            run(x, state)
    graph, _ = capture_graph(body)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    state.conv.copy_(saved[0])
    state.ssm.copy_(saved[1])
    return start.elapsed_time(end) * 1e3 / (reps * STEPS)


def candidates(batch: int, d_model: int, quick: bool):
    if batch < 16 or not quick:
        for channels, k_block, warps in itertools.product((16, 32), (32, 64), (4, 8)):
            if batch < 64:
                yield BackboneStepBlocks(1, channels, k_block, warps)
    if batch >= 16:
        for rows, channels, k_block, warps in itertools.product((16, 32), (16, 32), (32, 64), (4, 8)):
            if quick and (rows, k_block) != (16, 32):
                continue
            yield BackboneStepBlocks(rows, channels, k_block, warps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--json")
    ap.add_argument("--quick", action="store_true", help="fewer candidates at 16 rows and more")
    ap.add_argument("--shapes", default="128x3,512x4")
    ap.add_argument("--batches", default="1,4,16,64,256,1024,4096")
    ap.add_argument("--budget", type=float, default=480, help="seconds; stops sweeping after")
    args = ap.parse_args()
    t0 = time.time()
    n = 2**28
    a, b = torch.empty(n, device="cuda"), torch.empty(n, device="cuda")
    b.copy_(a)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        b.copy_(a)
    torch.cuda.synchronize()
    bw = 10 * 2 * 4 * n / (time.perf_counter() - t)
    del a, b
    print(f"device: {torch.cuda.get_device_name()}, copy rate {bw / 1e12:.2f} TB/s", flush=True)
    rows = []
    for name in args.shapes.split(","):
        for dtype in (torch.float32, torch.bfloat16):
            torch.manual_seed(0)
            bb = Backbone(BackboneConfig(**SHAPES[name]), device="cuda", dtype=dtype)
            c = bb.config
            for batch in map(int, args.batches.split(",")):
                if time.time() - t0 > args.budget:
                    print("budget spent: stopping", flush=True)
                    break
                state = bb.new_state(batch)
                x = torch.randn(batch, c.input_dim, device="cuda")
                floor = 2 * 4 * batch * c.n_layer * c.d_inner * (c.d_state + c.d_conv) / bw * 1e6
                with torch.no_grad():
                    results = [(gpu_us(KernelStep(bb, batch), x, state), "decode kernels")]
                    for blocks in candidates(batch, c.d_model, args.quick):
                        try:
                            results.append((gpu_us(FusedBackboneStep(bb, batch, blocks), x, state), blocks))
                        except Exception as e:  # (out of shared memory, say): noted, not fatal
                            print(f"  {blocks}: {type(e).__name__}: {str(e)[:120]}", flush=True)
                results.sort(key=lambda r: r[0])
                print(f"{name} {str(dtype)[6:]} batch {batch}: floor {floor:.1f} us", flush=True)
                for us, what in results[:4]:
                    print(f"   {us:8.1f} us  {what}", flush=True)
                kernels = next(us for us, what in results if what == "decode kernels")
                print(f"   {kernels:8.1f} us  decode kernels", flush=True)
                rows.append(dict(shape=name, dtype=str(dtype)[6:], batch=batch, floor_us=round(floor, 1),
                                 results=[dict(us=round(us, 2), what=str(what)) for us, what in results]))
            bb = None
            torch.cuda.empty_cache()
    if args.json:
        Path(args.json).write_text(json.dumps(dict(device=torch.cuda.get_device_name(), copy_tb_s=bw / 1e12, rows=rows), indent=2))


if __name__ == "__main__":
    main()
