"""Which decode step is fastest at which batch size: the numbers behind the plan table
(fastmamba/engine/plan.py: ROUTES for Mamba-1 layers, MAMBA2_ROUTES for Mamba-2's).

For each shape and batch size it times whole graph-replayed steps (random weights,
greedy sampling, as `fastmamba bench`) of every candidate step of the model's layer kind,

    Mamba-1 layers:
    one-row          kernels/decode_step.DecodeStep (batches up to 8)
    cuBLAS           kernels/decode_gemm.GemmDecodeStep, its products through cuBLAS
    Triton           ... through products.py's batch-invariant GEMM (the deterministic step)
    Triton+cuBLAS    ... through products.py but in_proj through cuBLAS
    Triton+cuBLAS in/out ... but in_proj and out_proj through cuBLAS
    Triton 1-chunk   ... the Triton products each in one K chunk
    Mamba-2 layers:
    one-row          kernels/decode_step_mamba2.Mamba2DecodeStep (batches up to 32)
    layer-ops cuBLAS the layer over the GPU ops, cuBLAS products (plan.LAYER_OPS)
    layer-ops Triton ... through invariant_gemm (plan.LAYER_OPS_DETERMINISTIC)

and marks the fastest, the one the table picks, and the step's floor (weights once, the
state read and written, at the copy rate measured here). The candidates run in the order
A B C D D C B A and each time is the mean of its two runs (a GPU's clock drifts as it
heats).

    python -m benchmarks.decode_routing                          # bf16, 4 shapes, 1-256 rows
    python -m benchmarks.decode_routing --models 2.8b --batches 16,32,48 --dtypes float32
    python -m benchmarks.decode_routing --candidates Triton,Triton+cuBLAS   # only these two
    python -m benchmarks.decode_routing --models mamba2-130m,mamba2-2.7b,codestral-7b --batches 1,2,4,8,32,128
    python -m benchmarks.decode_routing --models backbone-128x3 --dtypes float32 --batches 256,1024,4096

A model "backbone-DxL" is fastmamba.Backbone(d_model D, n_layer L) as its step runs it
(backbone_step.decode_model: the same kernels, an identity lm_head).
"""

import argparse
import json
from pathlib import Path

import torch

from fastmamba import bench
from fastmamba.core.dtypes import parse_dtype
from fastmamba.engine.plan import (
    ALL,
    IN_OUT_PROJ,
    IN_PROJ,
    LAYER_OPS,
    LAYER_OPS_DETERMINISTIC,
    NONE,
    PRODUCTS,
    DecodePlan,
    plan_for,
)

CANDIDATES = {  # a layer kind's candidate steps
    "mamba1": {
        "one-row": DecodePlan("one-row"),
        "cuBLAS": DecodePlan("products", ALL, pdl=False),
        "Triton": DecodePlan("products", NONE),
        "Triton+cuBLAS": DecodePlan("products", IN_PROJ),
        # in_proj and out_proj (the two large products) through cuBLAS, x_proj and dt_proj through Triton
        "Triton+cuBLAS in/out": DecodePlan("products", IN_OUT_PROJ),
        # the Triton products each in one K chunk (the table's splits serve batch 1's few programs)
        "Triton 1-chunk": DecodePlan("products", NONE, splits=tuple((p, 1) for p in PRODUCTS)),
    },
    "mamba2": {"one-row": DecodePlan("one-row"), "layer-ops cuBLAS": LAYER_OPS, "layer-ops Triton": LAYER_OPS_DETERMINISTIC},
}
ONE_ROW_UP_TO = {"mamba1": 8, "mamba2": 32}  # (past these the one-row step is far behind)
NAMES = list(dict.fromkeys(n for kind in CANDIDATES.values() for n in kind))


def model_of(size: str, dtype: torch.dtype):
    """A public shape's random model, or "backbone-DxL"'s decode model."""
    if not size.startswith("backbone-"):
        return bench.random_model(size, dtype)
    from fastmamba import Backbone, BackboneConfig
    from fastmamba.engine.backbone_step import decode_model

    d_model, n_layer = map(int, size.removeprefix("backbone-").split("x"))
    torch.manual_seed(0)
    bb = Backbone(BackboneConfig(input_dim=64, d_model=d_model, n_layer=n_layer), device="cuda", dtype=dtype)
    return decode_model(bb.requires_grad_(False))  # (as Backbone.step runs it: no autograd)


def describe(plan: DecodePlan, candidates: dict) -> str:
    """The candidate's name for a plan."""
    return next(n for n, p in candidates.items() if (p.step, p.cublas) == (plan.step, plan.cublas))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="130m,370m,1.4b,2.8b")
    ap.add_argument("--dtypes", default="bfloat16")
    ap.add_argument("--batches", default="1,2,3,4,8,16,32,48,64,128,256")
    ap.add_argument("--candidates", default=",".join(NAMES),
                    help="comma-separated, of: " + ", ".join(NAMES) + " (each model runs those of its layer kind)")
    ap.add_argument("--json")
    args = ap.parse_args()
    chosen = args.candidates.split(",")
    if unknown := set(chosen) - set(NAMES):
        ap.error(f"--candidates: unknown {', '.join(sorted(unknown))}")
    bw = bench.copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}, copy {bw / 1e12:.2f} TB/s; ms a step, * the fastest", flush=True)
    rows = []
    for size in args.models.split(","):
        for dtype in map(parse_dtype, args.dtypes.split(",")):
            model = model_of(size, dtype)
            kind = model.config.layer
            for batch in map(int, args.batches.split(",")):
                names = [n for n in chosen if n in CANDIDATES[kind] and (n != "one-row" or batch <= ONE_ROW_UP_TO[kind])]
                if not names:
                    continue
                ms = bench.time_graph_steps_abba({n: (model, CANDIDATES[kind][n]) for n in names}, batch, steps=100)
                best = min(ms, key=ms.get)
                routed = describe(plan_for(model.config, dtype, batch), CANDIDATES[kind])
                floor = bench.floor_ms(model, batch, bw)
                rows.append(dict(model=size, dtype=str(dtype).removeprefix("torch."), batch=batch, floor_ms=round(floor, 4),
                                 ms={n: round(t, 4) for n, t in ms.items()}, fastest=best, routed=routed))
                cells = "  ".join(f"{n} {t:.4f}{'*' if n == best else ''}" for n, t in ms.items())
                print(f"{size:>5} {str(dtype).removeprefix('torch.'):>8} batch {batch:3d}: {cells}  "
                      f"(floor {floor:.4f}; routed: {routed})", flush=True)
            del model
            torch.cuda.empty_cache()
    if args.json:
        Path(args.json).write_text(json.dumps(dict(device=torch.cuda.get_device_name(), copy_tbs=bw / 1e12, rows=rows), indent=2))


if __name__ == "__main__":
    main()
