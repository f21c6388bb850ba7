"""Where prefill time goes: torch.profiler's per-kernel GPU totals for one prefill at a
public shape (random weights, bf16). Prints the top kernels by total GPU time. With
--generate: the first token through the public path (`generate_batch`, max_tokens 1:
graph-captured prefill where it applies, the first sample, the read-back), the host's
functions by their own time (cProfile) beside the GPU's kernels.

    python benchmarks/profile_prefill.py --model 2.8b --batch 1 --tokens 8192 [--generate]
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from fastmamba.bench import random_model  # noqa: E402
from fastmamba.core.model import Mamba  # noqa: E402
from fastmamba.core.ops import triton_ops  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="2.8b")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--generate", action="store_true", help="through generate_batch, the host's time too")
    args = ap.parse_args()
    base = random_model(args.model, torch.bfloat16)
    model = Mamba(base.config, base.weights, triton_ops())
    ids = torch.randint(0, model.config.vocab_size, (args.batch, args.tokens), device="cuda")
    if args.generate:
        profile_generate(model, ids.tolist(), args.top)
        return
    model.prefill(ids, model.new_state(args.batch), last_only=True)  # compile
    torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        model.prefill(ids, model.new_state(args.batch), last_only=True)
        torch.cuda.synchronize()
    print(f"{args.model} {args.batch}x{args.tokens} bf16")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.top, max_name_column_width=60))


def profile_generate(model, prompts, top: int) -> None:
    import cProfile
    import pstats
    import time

    from fastmamba.engine.language_model import LanguageModel

    lm = LanguageModel(model, None, engine="triton")
    one = dict(max_tokens=1, stop_token_ids=[])
    for _ in range(3):  # captures the graphs, compiles
        lm.generate_batch(prompts, one)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(5):
        lm.generate_batch(prompts, one)
    print(f"generate_batch, {len(prompts)} x {len(prompts[0])} tokens, max_tokens 1: {(time.perf_counter() - t) / 5 * 1e3:.2f} ms")
    host = cProfile.Profile()
    host.enable()
    lm.generate_batch(prompts, one)
    host.disable()
    pstats.Stats(host).sort_stats("tottime").print_stats(top)
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        lm.generate_batch(prompts, one)
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=top, max_name_column_width=60))


if __name__ == "__main__":
    main()
