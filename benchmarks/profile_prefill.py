"""Where prefill time goes: torch.profiler's per-kernel GPU totals for one prefill at a
public shape (random weights, bf16). Prints the top kernels by total GPU time.

    python benchmarks/profile_prefill.py --model 2.8b --batch 1 --tokens 8192
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from fastmamba.bench import random_model  # noqa: E402
from fastmamba.model import Mamba, triton_ops  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="2.8b")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    base = random_model(args.model, torch.bfloat16)
    model = Mamba(base.config, base.weights, triton_ops())
    ids = torch.randint(0, model.config.vocab_size, (args.batch, args.tokens), device="cuda")
    model.prefill(ids, model.new_state(args.batch), last_only=True)  # compile
    torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        model.prefill(ids, model.new_state(args.batch), last_only=True)
        torch.cuda.synchronize()
    print(f"{args.model} {args.batch}x{args.tokens} bf16")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.top, max_name_column_width=60))


if __name__ == "__main__":
    main()
