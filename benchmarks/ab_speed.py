"""Decode-step and prefill times of one build, for comparing two builds in one device call:
run it once under each build's PYTHONPATH (it uses only what every build has). bf16,
random weights at public shapes; prints one JSON line per measurement.

    PYTHONPATH=before python benchmarks/ab_speed.py before; PYTHONPATH=. python benchmarks/ab_speed.py after
"""

import json
import sys
import time

import torch

from fastmamba.bench import random_model, time_graph_steps
from fastmamba.core.model import Mamba
from fastmamba.core.ops import triton_ops


def prefill_ms(model: Mamba, B: int, T: int) -> float:
    ids = torch.randint(0, model.config.vocab_size, (B, T), device="cuda")
    times = []
    for _ in range(4):  # the first warms up
        torch.cuda.synchronize()
        t = time.perf_counter()
        model.prefill(ids, model.new_state(B), last_only=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return sorted(times[1:])[1] * 1e3


def main() -> None:
    label = sys.argv[1] if len(sys.argv) > 1 else "build"
    for size, batches, prefills in (("2.8b", (1, 32, 128), ((1, 8192),)), ("130m", (1,), ((1, 8192),))):
        base = random_model(size, torch.bfloat16)
        model = Mamba(base.config, base.weights, triton_ops())
        for B in batches:
            print(json.dumps(dict(build=label, model=size, decode_batch=B, ms=round(time_graph_steps(model, B), 4))), flush=True)
        for B, T in prefills:
            print(json.dumps(dict(build=label, model=size, prefill=f"{B}x{T}", ms=round(prefill_ms(model, B, T), 2))), flush=True)
        model = base = None
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
