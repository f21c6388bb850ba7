"""Fuzzing the loader (hypothesis, bounded): config.json values and corrupted weight bytes
give a loaded model or a CheckpointError, never another exception, and each load stays
within a fixed time, and the whole run within a fixed memory ceiling (an address-space
limit on the subprocess it runs in: an allocation past it fails as MemoryError)."""

from __future__ import annotations

import subprocess
import sys

MEMORY_CEILING = 6 * 2**30  # address space of the fuzzing process, torch included
SECONDS_A_LOAD = 10

FUZZ = r"""
import json, resource, shutil, sys, tempfile, time
from pathlib import Path

resource.setrlimit(resource.RLIMIT_AS, (MEMORY_CEILING, MEMORY_CEILING))

from hypothesis import HealthCheck, given, settings, strategies as st
import fastmamba

src = Path(sys.argv[1])
base = json.loads((src / "config.json").read_text())
weights = (src / "model.safetensors").read_bytes()
KEYS = ["hidden_size", "num_hidden_layers", "state_size", "conv_kernel", "expand", "intermediate_size",
        "time_step_rank", "use_bias", "use_conv_bias", "layer_norm_epsilon", "vocab_size",
        "tie_word_embeddings", "eos_token_id", "model_type", "d_model", "n_layer", "ssm_cfg"]
values = st.one_of(
    st.integers(-3, 64), st.sampled_from([10**6, 10**7, 10**9, 10**12, 2**31, 2**63, 10**30]),
    st.floats(allow_nan=True, allow_infinity=True), st.booleans(), st.none(), st.just("auto"),
    st.text(max_size=6), st.lists(st.integers(-1, 10**9), max_size=3),
    st.dictionaries(st.sampled_from(["d_state", "expand", "layer", "dt_rank"]), st.integers(-1, 10**9), max_size=2),
)


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(
    changes=st.dictionaries(st.sampled_from(KEYS), values, max_size=4),
    drop=st.lists(st.sampled_from(KEYS), max_size=2),
    cut=st.one_of(st.none(), st.integers(0, len(weights))),
    flips=st.lists(st.tuples(st.integers(0, len(weights) - 1), st.integers(0, 255)), max_size=3),
)
def fuzz(changes, drop, cut, flips):
    cfg = {k: v for k, v in {**base, **changes}.items() if k not in drop}
    data = bytearray(weights if cut is None else weights[:cut])
    for at, byte in flips:
        if at < len(data):
            data[at] = byte
    folder = Path(tempfile.mkdtemp())
    try:
        (folder / "config.json").write_text(json.dumps(cfg))
        (folder / "model.safetensors").write_bytes(bytes(data))
        t0 = time.perf_counter()
        try:
            fastmamba.load(folder)
        except fastmamba.CheckpointError:
            pass
        assert time.perf_counter() - t0 < SECONDS_A_LOAD, f"a load took {time.perf_counter() - t0:.1f} s"
    finally:
        shutil.rmtree(folder)


fuzz()
print("fuzzed")
"""


def test_loader_fuzz(checkpoints):
    code = FUZZ.replace("MEMORY_CEILING", str(MEMORY_CEILING)).replace("SECONDS_A_LOAD", str(SECONDS_A_LOAD))
    code = code.replace("EXAMPLES", "300")
    r = subprocess.run([sys.executable, "-c", code, str(checkpoints["untied_bias_rank"])],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and r.stdout.strip() == "fuzzed", f"exit {r.returncode}: {r.stdout[-3000:]}{r.stderr[-3000:]}"
