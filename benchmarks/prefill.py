"""Prefill benchmark: tokens/s of the Triton prefill at public shapes (random weights, bf16),
time to first token through `generate` / `generate_batch` (1 x 128, 1 x 2048, 1 x 8192,
8 x 2048: graph-captured prefill where cuda_graphs.graph_prefill_tokens says), and peak memory of a 100k-token prompt;
with --hf, transformers' forward over the same 1 x 8192 prompt for a ratio.

    python benchmarks/prefill.py --models 130m,2.8b,falcon-7b [--hf] --json prefill.json
"""

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from fastmamba.bench import SHAPES, hf_model, random_model  # noqa: E402
from fastmamba.core.model import Mamba  # noqa: E402
from fastmamba.core.ops import triton_ops  # noqa: E402
from fastmamba.engine.language_model import LanguageModel  # noqa: E402


def timed(fn, repeat=3) -> float:
    """Median wall seconds of fn() (synchronised), after one warm-up."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--json")
    ap.add_argument("--long", type=int, default=100_000, help="tokens of the long-prompt run on 130m")
    ap.add_argument("--models", default="130m,2.8b", help=f"comma-separated, of {', '.join(SHAPES)}")
    ap.add_argument("--hf", action="store_true", help="also time transformers' forward at 1 x 8192")
    args = ap.parse_args()
    rows = []
    print(f"device: {torch.cuda.get_device_name()}")
    print(f"{'model':>6} {'shape':>8} {'ms':>9} {'tokens/s':>10} {'peak GiB':>8}")
    for size in args.models.split(","):
        base = random_model(size, torch.bfloat16)
        model = Mamba(base.config, base.weights, triton_ops())
        V = model.config.vocab_size
        for B, T in ((1, 2048), (1, 8192), (8, 2048)):
            ids = torch.randint(0, V, (B, T), device="cuda")
            torch.cuda.reset_peak_memory_stats()
            s = timed(lambda: model.prefill(ids, model.new_state(B), last_only=True))
            row = dict(model=size, batch=B, tokens=T, ms=round(s * 1e3, 2), tokens_per_s=round(B * T / s),
                       peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2))
            rows.append(row)
            print(f"{size:>6} {B:>3}x{T:<5} {row['ms']:9.2f} {row['tokens_per_s']:10,} {row['peak_gib']:8.2f}", flush=True)
        if args.hf:
            hf = hf_model(model.config, torch.bfloat16)
            ids = torch.randint(0, V, (1, 8192), device="cuda")
            with torch.inference_mode():
                s = timed(lambda: hf(ids, use_cache=False).logits[:, -1], repeat=1)
            rows.append(dict(model=size, batch=1, tokens=8192, hf_ms=round(s * 1e3, 1)))
            print(f"{size:>6} transformers, 1x8192: {s * 1e3:.0f} ms", flush=True)
            hf = None
            torch.cuda.empty_cache()
        # Time to first token: a prompt in, the first token's id back on the host, through
        # the public generation path (its graph-captured prefill), against the eager prefill.
        lm = LanguageModel(model, None, engine="triton")
        for B, n in ((1, 128), (1, 2048), (1, 8192), (8, 2048)):
            prompts = torch.randint(0, V, (B, n)).tolist()
            one = dict(max_tokens=1, stop_token_ids=[])
            ttft = timed(lambda: lm.generate(prompts[0], **one) if B == 1 else lm.generate_batch(prompts, one), repeat=10)
            eager = timed(lambda: model.prefill(torch.tensor(prompts, device="cuda"), model.new_state(B), last_only=True).argmax(-1).tolist(), repeat=10)
            rows.append(dict(model=size, batch=B, prompt_tokens=n, ttft_ms=round(ttft * 1e3, 3), eager_prefill_ms=round(eager * 1e3, 3)))
            print(f"{size:>6} time to first token, {B} x {n}-token prompt{'s' if B > 1 else ''}: {ttft * 1e3:.2f} ms "
                  f"(eager prefill, no graph: {eager * 1e3:.2f} ms)", flush=True)
        if size == "130m":
            ids = torch.randint(0, V, (1, args.long), device="cuda")
            torch.cuda.reset_peak_memory_stats()
            t = time.perf_counter()
            model.prefill(ids, model.new_state(1), last_only=True)
            torch.cuda.synchronize()
            long_s = time.perf_counter() - t
            peak = torch.cuda.max_memory_allocated() / 2**30
            rows.append(dict(model=size, long_tokens=args.long, ms=round(long_s * 1e3, 1), peak_gib=round(peak, 2)))
            print(f"{size:>6} {args.long:,}-token prompt: {long_s * 1e3:.0f} ms, peak {peak:.2f} GiB (chunks of {model.chunk_tokens} tokens)", flush=True)
        model = base = lm = None  # free the weights and graphs before the next size
        torch.cuda.empty_cache()
    if args.json:
        Path(args.json).write_text(json.dumps(dict(device=torch.cuda.get_device_name(), rows=rows), indent=2))


if __name__ == "__main__":
    main()
