"""CPU generation speed by PyTorch thread count, idle and beside busy neighbours.

For the CLI's default thread count: per-token products on the CPU are small, so a thread
that waits for a core another process holds stalls every product. Prints tokens/s for the
bundled model and for 130m shapes (random weights, float32) at each thread count, with 0, 1
and 2 single-threaded busy-loop processes beside it.

    python -m benchmarks.cpu_threads --threads 1,2 --neighbours 0,1,2
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import time

import torch

import fastmamba
from fastmamba.bench import random_model
from fastmamba.engine.language_model import LanguageModel


def spin():
    while True:
        pass


def tokens_per_second(lm: LanguageModel, tokens: int) -> float:
    lm.generate([1, 2, 3], max_tokens=2, stop_token_ids=[])  # warm-up
    t0 = time.perf_counter()
    lm.generate([1, 2, 3], max_tokens=tokens, stop_token_ids=[])
    return tokens / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--neighbours", default="0,1,2")
    args = ap.parse_args()
    models = {"bundled": fastmamba.load(), "130m": LanguageModel(random_model("130m", torch.float32, "cpu"), None)}
    print(f"{'model':8} {'neighbours':>10} {'threads':>7} {'tokens/s':>9}")
    for neighbours in [int(n) for n in args.neighbours.split(",")]:
        busy = [mp.Process(target=spin, daemon=True) for _ in range(neighbours)]
        for p in busy:
            p.start()
        try:
            for name, lm in models.items():
                tokens = args.tokens if name == "bundled" else args.tokens // 4
                for threads in [int(t) for t in args.threads.split(",")]:
                    lm.threads = threads
                    print(f"{name:8} {neighbours:>10} {threads:>7} {tokens_per_second(lm, tokens):>9.1f}", flush=True)
        finally:
            for p in busy:
                p.terminate()


if __name__ == "__main__":
    main()
