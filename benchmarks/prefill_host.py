"""Is eager prefill host-bound? For each shape: the host's time to issue one eager prefill
(launched behind a long GPU sleep, so no launch waits on the GPU), the eager prefill's
wall time, and the same prefill replayed as a CUDA graph (cuda_graphs.GraphPrefill).

    python benchmarks/prefill_host.py --models 130m,2.8b
"""

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from fastmamba.bench import random_model  # noqa: E402
from fastmamba.engine.cuda_graphs import GraphPrefill  # noqa: E402
from fastmamba.core.model import Mamba  # noqa: E402
from fastmamba.core.ops import triton_ops  # noqa: E402
from prefill import timed  # noqa: E402  (benchmarks/prefill.py)


def issue_ms(fn) -> float:
    """Host time to issue fn's launches while the GPU is busy with a long sleep."""
    fn()
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # ~1 s of GPU cycles ahead of the launches
    t = time.perf_counter()
    fn()
    ms = (time.perf_counter() - t) * 1e3
    torch.cuda.synchronize()
    return ms


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="130m,2.8b")
    ap.add_argument("--shapes", default="1x2048,1x8192,8x2048")
    args = ap.parse_args()
    for size in args.models.split(","):
        base = random_model(size, torch.bfloat16)
        model = Mamba(base.config, base.weights, triton_ops())
        for shape in args.shapes.split(","):
            B, T = map(int, shape.split("x"))
            ids = torch.randint(0, model.config.vocab_size, (B, T), device="cuda")
            start = torch.zeros(B, dtype=torch.int32, device="cuda")

            def eager():
                return model.prefill(ids, model.new_state(B), last_only=True)

            host, wall = issue_ms(eager), timed(eager, 5) * 1e3
            t = time.perf_counter()
            graph = GraphPrefill(model, B, T)
            capture = (time.perf_counter() - t) * 1e3
            replay = timed(lambda: graph(ids, start), 5) * 1e3
            print(f"{size:>5} {B}x{T}: eager {wall:7.2f} ms (host issue {host:6.2f}), graph {replay:7.2f} ms "
                  f"(capture {capture:.0f} ms)", flush=True)
            graph = None  # free its pool before the next shape
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
