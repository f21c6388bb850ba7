"""Per-kernel GPU time of one decode step (torch.profiler), to see where a step's time goes.

    python benchmarks/profile_step.py --model 2.8b --batch 1
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from fastmamba.bench import random_model  # noqa: E402
from fastmamba.checkpoint import parse_dtype  # noqa: E402
from fastmamba.kernels.decode_step import make_decode_step  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="2.8b")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--deterministic", action="store_true", help="the batch-invariant step")
    args = ap.parse_args()
    model = random_model(args.model, parse_dtype(args.dtype))
    step = make_decode_step(model, args.batch, args.deterministic)  # the step the engine would run
    state = model.new_state(args.batch)
    tokens = torch.zeros(args.batch, dtype=torch.int64, device="cuda")
    for _ in range(3):
        step(tokens, state)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            step(tokens, state)
        torch.cuda.synchronize()
    print(f"{args.model} {args.dtype} batch {args.batch}")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=50))


if __name__ == "__main__":
    main()
