"""Where prefill time goes: torch.profiler's per-kernel GPU totals for one prefill at a
public shape (random weights, bf16 or --dtype). Prints the top kernels by total GPU time. With
--generate: the first token through the public path (`generate_batch`, max_tokens 1:
graph-captured prefill where it applies, the first sample, the read-back), the host's
functions by their own time (cProfile) beside the GPU's kernels.

    python -m benchmarks.profile_prefill --model 2.8b --batch 1 --tokens 8192 [--dtype fp8] [--generate]
"""

import argparse

import torch

from benchmarks.profile_step import print_kernel_times
from fastmamba.bench import host_us, random_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="2.8b")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--dtype", default="bfloat16", help="the weights' storage dtype (bfloat16, fp8, ...)")
    ap.add_argument("--generate", action="store_true", help="through generate_batch, the host's time too")
    args = ap.parse_args()
    from fastmamba.core.dtypes import parse_dtype

    model = random_model(args.model, parse_dtype(args.dtype))
    ids = torch.randint(0, model.config.vocab_size, (args.batch, args.tokens), device="cuda")
    if args.generate:
        profile_generate(model, ids.tolist(), args.top)
        return
    print_kernel_times(lambda: model.prefill(ids, model.new_state(args.batch), last_only=True),
                       f"{args.model} {args.batch}x{args.tokens} {args.dtype} prefill", warm=1, calls=1, rows=args.top, host=True,
                       width=60)


def profile_generate(model, prompts, top: int) -> None:
    import cProfile
    import pstats

    from fastmamba.engine.language_model import LanguageModel

    lm = LanguageModel(model, None, engine="triton")
    one = dict(max_tokens=1, stop_token_ids=[])
    ms = host_us(lambda: lm.generate_batch(prompts, one), 5) / 1e3  # (its warm-up captures the graphs, compiles)
    print(f"generate_batch, {len(prompts)} x {len(prompts[0])} tokens, max_tokens 1: {ms:.2f} ms")
    host = cProfile.Profile()
    host.enable()
    lm.generate_batch(prompts, one)
    host.disable()
    pstats.Stats(host).sort_stats("tottime").print_stats(top)
    print_kernel_times(lambda: lm.generate_batch(prompts, one), "generate_batch", warm=0, calls=1, rows=top, host=True,
                       width=60)


if __name__ == "__main__":
    main()
