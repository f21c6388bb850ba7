"""End-to-end decode speed as a user sees it: `LanguageModel.generate` of 256 tokens at
batch 1 (host loop, read-backs and all), with 1 and with several decode steps per graph
replay (engine.STEPS_PER_READ). Random weights at public shapes, bf16, greedy.

    python benchmarks/generate_speed.py
"""

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from fastmamba import engine  # noqa: E402
from fastmamba.bench import random_model  # noqa: E402
from fastmamba.generate import LanguageModel  # noqa: E402


def main() -> None:
    tokens = 256
    for size in ("130m", "2.8b"):
        model = random_model(size, torch.bfloat16)
        for steps in (1, 4, 8):
            engine.STEPS_PER_READ = steps
            lm = LanguageModel(model, None, engine="triton")
            lm.generate([1, 2, 3], max_tokens=tokens, stop_token_ids=[])  # capture, compile
            best = float("inf")
            for _ in range(3):
                torch.cuda.synchronize()
                t = time.perf_counter()
                lm.generate([1, 2, 3], max_tokens=tokens, stop_token_ids=[])
                best = min(best, time.perf_counter() - t)
            print(f"{size:>5} steps per read-back {steps}: {best / tokens * 1e3:.3f} ms/token end to end", flush=True)
        model = None
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
