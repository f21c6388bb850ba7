"""End-to-end decode speed as a user sees it: `LanguageModel.generate` at batch 1 (the
engine's step loop, a step ahead, read-backs and all), against the graph replays alone
(`fastmamba bench`'s number).
Random weights at public shapes, bf16, greedy, a 3-token prompt; the Triton prefill, as
`fastmamba.load` gives on a GPU. It prints the first token's time (prefill, first sample,
the decoder's set-up) and the time a token after it, (t(257 tokens) - t(1 token)) / 256.

    python benchmarks/generate_speed.py
"""

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from fastmamba.bench import random_model, time_graph_steps  # noqa: E402
from fastmamba.engine.language_model import LanguageModel  # noqa: E402
from fastmamba.core.model import Mamba  # noqa: E402
from fastmamba.core.ops import triton_ops  # noqa: E402

TOKENS = 256


def best_ms(lm: LanguageModel, max_tokens: int, reps: int = 5) -> float:
    best = float("inf")
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        lm.generate([1, 2, 3], max_tokens=max_tokens, stop_token_ids=[])
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def main() -> None:
    for size in ("130m", "2.8b"):
        base = random_model(size, torch.bfloat16)
        model = Mamba(base.config, base.weights, triton_ops())
        print(f"{size:>5} graph replays alone: {time_graph_steps(model, 1):.3f} ms/step", flush=True)
        lm = LanguageModel(model, None, engine="triton")
        lm.generate([1, 2, 3], max_tokens=TOKENS + 1, stop_token_ids=[])  # capture, compile
        first, whole = best_ms(lm, 1), best_ms(lm, TOKENS + 1)
        print(f"{size:>5} generate: first token {first:.3f} ms, then {(whole - first) / TOKENS:.3f} ms/token end to end",
              flush=True)
        model = base = None
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
