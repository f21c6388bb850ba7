"""The serving path's host cost alone, on the CPU: the HTTP server and the engine loop
with the model's work replaced by a fixed wait that releases the interpreter's lock (as
a GPU step's wait does), so what is measured is the per-token Python work: the engine's
bookkeeping, the hand-over to the event loop, the chunks' JSON and socket writes.

Streams of `--tokens` tokens each from `--streams` concurrent clients (in processes of
their own); prints output tokens/s and the inter-token latency against the fixed step.

    python benchmarks/serve_host.py --streams 64 --step-ms 4
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import fastmamba  # noqa: E402
from fastmamba.scheduler import Engine  # noqa: E402
from fastmamba.server import create_app, metrics_registry  # noqa: E402


class HostOnlyEngine(Engine):
    """The engine loop as it runs, with prefill and the decode step's compute replaced by
    a wait of `step_s` a step (the token is always the same id)."""

    step_s = 0.004

    def _prefill(self):
        for r in self.slots:
            if r is not None and not r.finished and r.pos < len(r.ids):
                r.pos = len(r.ids)
                self._accept(r, 5, None)

    def _decode(self):
        rows = [r for r in self.slots if self._decoding(r)]
        if rows:
            time.sleep(self.step_s)
        for r in rows:
            self._accept(r, 5, None)


def main() -> None:
    from serve import http_level, pct, start_clients, start_server

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--step-ms", type=float, default=4.0)
    ap.add_argument("--clients", type=int, default=2)
    args = ap.parse_args()
    lm = fastmamba.load()
    registry, metrics = metrics_registry()
    HostOnlyEngine.step_s = args.step_ms / 1e3
    engine = HostOnlyEngine(lm, max_batch=args.streams, metrics=metrics).start()
    server, url = start_server(create_app(engine, "m", registry=registry))
    clients = start_clients(args.clients)
    jobs = [([1, 2, 3], args.tokens)] * args.streams
    results, wall = http_level(clients, url, jobs, args.streams)
    tokens = sum(max(r[2], 0) for r in results)
    gaps = [g for r in results for g in r[1]]
    print(f"{args.streams} streams x {args.tokens} tokens, step {args.step_ms} ms: {tokens / wall:.0f} tok/s "
          f"(a step's pace alone: {args.streams / (args.step_ms / 1e3):.0f}), ITL p50 {pct(gaps, 0.5) * 1e3:.2f} ms, "
          f"p99 {pct(gaps, 0.99) * 1e3:.2f}, mean {statistics.mean(gaps) * 1e3:.2f}; lost {sum(r[2] != args.tokens for r in results)}")
    server.should_exit = True
    engine.shutdown()


if __name__ == "__main__":
    main()
