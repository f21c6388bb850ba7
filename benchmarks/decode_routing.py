"""Which decode step is fastest at which batch size: the numbers behind the plan table
(fastmamba/decode_plan.py).

For each public shape and batch size it times whole graph-replayed steps (random weights,
greedy sampling, as `fastmamba bench`) of every candidate step:

    one-row          decode_step.DecodeStep (batches up to 8)
    cuBLAS           decode_gemm.GemmDecodeStep, its products through cuBLAS
    Triton           ... through products.py's batch-invariant GEMM (the deterministic step)
    Triton+cuBLAS    ... through products.py but in_proj through cuBLAS

and marks the fastest, and the one the table picks. The candidates run in the
order A B C D D C B A and each time is the mean of its two runs (a GPU's clock drifts as it
heats).

    python benchmarks/decode_routing.py                          # bf16, 4 shapes, 1-256 rows
    python benchmarks/decode_routing.py --models 2.8b --batches 16,32,48 --dtypes float32
    python benchmarks/decode_routing.py --candidates Triton,Triton+cuBLAS   # only these two
    python benchmarks/decode_routing.py --models backbone-128x3 --dtypes float32 --batches 256,1024,4096

A model "backbone-DxL" is fastmamba.Backbone(d_model D, n_layer L) as its step runs it
(backbone.decode_model: the same kernels, an identity lm_head).
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from fastmamba import bench  # noqa: E402
from fastmamba.core.dtypes import parse_dtype  # noqa: E402
from fastmamba import Backbone, BackboneConfig  # noqa: E402
from fastmamba.engine.backbone import decode_model  # noqa: E402
from fastmamba.engine.plan import ALL, IN_PROJ, NONE, PRODUCTS, DecodePlan, plan_for  # noqa: E402

CANDIDATES = {
    "one-row": DecodePlan("one-row"),
    "cuBLAS": DecodePlan("products", ALL, pdl=False),
    "Triton": DecodePlan("products", NONE),
    "Triton+cuBLAS": DecodePlan("products", IN_PROJ),
    # the Triton products each in one K chunk (the table's splits serve batch 1's few programs)
    "Triton 1-chunk": DecodePlan("products", NONE, splits=tuple((p, 1) for p in PRODUCTS)),
}


def model_of(size: str, dtype: torch.dtype):
    """A public shape's random model, or "backbone-DxL"'s decode model."""
    if not size.startswith("backbone-"):
        return bench.random_model(size, dtype)
    d_model, n_layer = map(int, size.removeprefix("backbone-").split("x"))
    torch.manual_seed(0)
    bb = Backbone(BackboneConfig(input_dim=64, d_model=d_model, n_layer=n_layer), device="cuda", dtype=dtype)
    return decode_model(bb.requires_grad_(False))  # (as Backbone.step runs it: no autograd)


def describe(plan: DecodePlan) -> str:
    """The candidate's name for a plan."""
    return next(n for n, p in CANDIDATES.items() if (p.step, p.cublas) == (plan.step, plan.cublas))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="130m,370m,1.4b,2.8b")
    ap.add_argument("--dtypes", default="bfloat16")
    ap.add_argument("--batches", default="1,2,3,4,8,16,32,48,64,128,256")
    ap.add_argument("--candidates", default=",".join(CANDIDATES), help="comma-separated, of: " + ", ".join(CANDIDATES))
    args = ap.parse_args()
    chosen = args.candidates.split(",")
    if unknown := set(chosen) - set(CANDIDATES):
        ap.error(f"--candidates: unknown {', '.join(sorted(unknown))}")
    print(torch.cuda.get_device_name(), flush=True)
    for size in args.models.split(","):
        for dtype in map(parse_dtype, args.dtypes.split(",")):
            model = model_of(size, dtype)
            for batch in map(int, args.batches.split(",")):
                names = [n for n in chosen if n != "one-row" or batch <= 8]
                runs = {n: [] for n in names}
                for n in names + names[::-1]:
                    runs[n].append(bench.time_graph_steps(model, batch, steps=100, plan=CANDIDATES[n]))
                ms = {n: sum(t) / len(t) for n, t in runs.items()}
                best = min(ms, key=ms.get)
                routed = describe(plan_for(model.config, dtype, batch))
                cells = "  ".join(f"{n} {t:.4f}{'*' if n == best else ''}" for n, t in ms.items())
                print(f"{size:>5} {str(dtype).removeprefix('torch.'):>8} batch {batch:3d}: {cells}  (routed: {routed})", flush=True)
            del model
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
