"""Which decode step is fastest at which batch size: the numbers behind make_decode_step's
routing (decode_step.one_row_up_to, triton_products_up_to, cublas_in_proj).

For each public shape and batch size it times whole graph-replayed steps (random weights,
greedy sampling, as `fastmamba bench`) of every candidate step:

    one-row          decode_step.DecodeStep (batches up to decode_step.SMALL_BATCH)
    cuBLAS           decode_gemm.GemmDecodeStep, its products through cuBLAS
    Triton           ... through gemm.py's batch-invariant GEMM (the deterministic step)
    Triton+cuBLAS    ... through gemm.py but in_proj through cuBLAS

and marks the fastest, and the one make_decode_step picks. The candidates run in the
order A B C D D C B A and each time is the mean of its two runs (a GPU's clock drifts as it
heats).

    python benchmarks/decode_routing.py                          # bf16, 4 shapes, 1-256 rows
    python benchmarks/decode_routing.py --models 2.8b --batches 16,32,48 --dtypes float32
    python benchmarks/decode_routing.py --candidates Triton,Triton+cuBLAS   # only these two
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from fastmamba import bench  # noqa: E402
from fastmamba.checkpoint import parse_dtype  # noqa: E402
from fastmamba.kernels import decode_step  # noqa: E402
from fastmamba.kernels.decode_gemm import GemmDecodeStep  # noqa: E402

CANDIDATES = {
    "one-row": lambda model, batch: decode_step.DecodeStep(model, batch),
    "cuBLAS": lambda model, batch: GemmDecodeStep(model, batch),
    "Triton": lambda model, batch: GemmDecodeStep(model, batch, triton_products=True),
    "Triton+cuBLAS": lambda model, batch: GemmDecodeStep(model, batch, triton_products=True, cublas_in_proj=True),
}
ROUTED = decode_step.make_decode_step


def describe(step) -> str:
    """The candidate's name for a step make_decode_step built."""
    if isinstance(step, decode_step.DecodeStep):
        return "one-row"
    if not step.triton_products:
        return "cuBLAS"
    return "Triton+cuBLAS" if step.cublas_products else "Triton"


def time_step(model, batch: int, make) -> float:
    # GraphDecoder builds its step through decode_step.make_decode_step: swapped for the
    # candidate's while it captures
    decode_step.make_decode_step = lambda m, b, deterministic=False: make(m, b)
    try:
        return bench.time_graph_steps(model, batch, steps=100)
    finally:
        decode_step.make_decode_step = ROUTED


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
            model = bench.random_model(size, dtype)
            for batch in map(int, args.batches.split(",")):
                names = [n for n in chosen if n != "one-row" or batch <= decode_step.SMALL_BATCH]
                runs = {n: [] for n in names}
                for n in names + names[::-1]:
                    runs[n].append(time_step(model, batch, CANDIDATES[n]))
                ms = {n: sum(t) / len(t) for n, t in runs.items()}
                best = min(ms, key=ms.get)
                routed = describe(ROUTED(model, batch))
                cells = "  ".join(f"{n} {t:.4f}{'*' if n == best else ''}" for n, t in ms.items())
                print(f"{size:>5} {str(dtype).removeprefix('torch.'):>8} batch {batch:3d}: {cells}  (routed: {routed})", flush=True)
            del model
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
