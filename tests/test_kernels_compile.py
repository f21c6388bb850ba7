"""Every Triton kernel compiles for sm_90 (no GPU needed: Triton ships ptxas)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")


def test_kernels_compile_for_hopper():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).resolve().parents[1] / "tools" / "compile_kernels.py"
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    # four decode dtypes (FP8's e4m3 among them), the products' step's kernels, prefill,
    # training, Mamba-2, sampler, a hybrid's decode attention, the Backbone's lockstep step
    assert r.stdout.count(": ok") == 11, r.stdout


def test_step_timeline_marks_every_layer_kernel(monkeypatch):
    """benchmarks/step_timeline.py rewrites decode_step.py's layer kernels: each gets its
    three marks (start, after the wait, end) and each launch the timeline's arguments, and
    the rewritten module imports."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import step_timeline

    src = step_timeline.instrumented_source()
    kernels = len(step_timeline.KERNELS)
    for col in range(3):
        assert src.count(f"_timeline_mark(tm_ptr, TM_ON, {col})") == kernels
    assert src.count("**self.timeline_args(") == kernels
    assert hasattr(step_timeline.load_instrumented().DecodeStep, "timeline_args")
