"""The benchmarks' own harness on the CPU at a tiny shape, so that a device call does not
find its faults: what a benchmark waits for comes, and it reports."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_hybrid_decode_benchmark_ends_when_its_prefill_outlasts_the_first_rows_outputs():
    """4 rows of 256 tokens, prefilled 16 a step: 64 steps, longer than the 3 x 1 + 32 tokens
    the first rows used to decode while the last came in (128 rows of 16k tokens at 8192 a
    step did the same on a GPU, and its wait for all rows decoding never ended)."""
    cmd = [sys.executable, "-m", "benchmarks.hybrid", "--shape", "nemotron-h-tiny", "--device", "cpu", "--no-hf",
           "--batches", "4", "--context", "256", "--steps", "1", "--prefill-tokens", "16", "--long", "0",
           "--prefills", "none"]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    decode = [row for row in rows if row.get("what") == "decode"]
    assert len(decode) == 1 and decode[0]["batch"] == 4 and decode[0]["context"] == 256 and decode[0]["ms"] > 0
