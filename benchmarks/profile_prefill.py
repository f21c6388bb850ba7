"""Where prefill time goes: torch.profiler's per-kernel GPU totals for one prefill at a
public shape (random weights, bf16 or --dtype; a hybrid's in bf16). Prints the top kernels by
total GPU time. With --generate: the first token through the public path (`generate_batch`, max_tokens 1:
graph-captured prefill where it applies, the first sample, the read-back), the host's
functions by their own time (cProfile) beside the GPU's kernels. With --served: a prompt's
first token through a server's engine core (its prefix cache on, so a prompt longer than the
cache's interval prefills in chunks of it; kernels compiled first, as serve does), the wall
time, the host's functions and the GPU's kernels.

    python -m benchmarks.profile_prefill --model 2.8b --batch 1 --tokens 8192 [--dtype fp8] [--generate | --served]
"""

import argparse

import torch

from benchmarks.hybrid import model_of
from benchmarks.profile_step import print_kernel_times
from fastmamba.bench import HYBRID_SHAPES, host_us, random_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="2.8b")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--dtype", default="bfloat16", help="the weights' storage dtype (bfloat16, fp8, ...)")
    ap.add_argument("--generate", action="store_true", help="through generate_batch, the host's time too")
    ap.add_argument("--served", action="store_true", help="through a server's engine core, the host's time too")
    args = ap.parse_args()
    from fastmamba.core.dtypes import parse_dtype

    if args.model in HYBRID_SHAPES:  # (bf16 weights, as the hybrid benchmark's)
        model = model_of(args.model, "cuda")[0]
    else:
        model = random_model(args.model, parse_dtype(args.dtype))
    ids = torch.randint(0, model.config.vocab_size, (args.batch, args.tokens), device="cuda")
    if args.generate or args.served:
        (profile_served if args.served else profile_generate)(model, ids.tolist(), args.top)
        return
    print_kernel_times(lambda: model.prefill(ids, model.new_state(args.batch), last_only=True),
                       f"{args.model} {args.batch}x{args.tokens} {args.dtype} prefill", warm=1, calls=1, rows=args.top, host=True,
                       width=60)


def profile_generate(model, prompts, top: int) -> None:
    from fastmamba.engine.language_model import LanguageModel

    lm = LanguageModel(model, None, engine="triton")
    one = dict(max_tokens=1, stop_token_ids=[])
    ms = host_us(lambda: lm.generate_batch(prompts, one), 5) / 1e3  # (its warm-up captures the graphs, compiles)
    print(f"generate_batch, {len(prompts)} x {len(prompts[0])} tokens, max_tokens 1: {ms:.2f} ms")
    profile_host_and_kernels(lambda: lm.generate_batch(prompts, one), "generate_batch", top)


def profile_served(model, prompts, top: int) -> None:
    from fastmamba.core.sampling_params import SamplingParams
    from fastmamba.engine.engine_core import EngineCore
    from fastmamba.engine.language_model import LanguageModel
    from fastmamba.engine.memory import kv_cache_tokens
    from fastmamba.engine.protocol import Request

    lm = LanguageModel(model, None, engine="triton")
    # (a hybrid's KV cache as a server sizes it: of a fixed size on a GPU, which decides its graphs)
    core = EngineCore(model, lm.prefill, max_batch=64, prefill_tokens=4096, prefix_cache_bytes=1 << 30,
                      kv_tokens=kv_cache_tokens(model, None, 64))
    core.capture_prefill_graphs()  # (serve's start: graphs captured, or a hybrid's kernels compiled)
    rid = 0

    def first_tokens():  # (new prompts each time, so that none is found in the prefix cache)
        nonlocal rid
        for p in prompts:
            rid += 1
            ids = [(t + rid) % (model.config.vocab_size - 1) + 1 for t in p]
            core.add(Request(rid, ids, SamplingParams(max_tokens=1, stop_token_ids=[])))
        while core.has_work:
            core.step()

    ms = host_us(first_tokens, 5) / 1e3
    print(f"served engine core (prefix cache on, interval {core.cache.interval}), {len(prompts)} x {len(prompts[0])} "
          f"tokens, max_tokens 1: {ms:.2f} ms")
    profile_host_and_kernels(first_tokens, "served first tokens", top)


def profile_host_and_kernels(fn, title: str, top: int) -> None:
    """One call of fn under cProfile (the host's functions by their own time), then one under
    torch.profiler (the GPU's kernels)."""
    import cProfile
    import pstats

    host = cProfile.Profile()
    host.enable()
    fn()
    host.disable()
    pstats.Stats(host).sort_stats("tottime").print_stats(top)
    print_kernel_times(fn, title, warm=0, calls=1, rows=top, host=True, width=60)


if __name__ == "__main__":
    main()
