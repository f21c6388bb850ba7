"""The bundled model: loads with no path, matches transformers, and generates on the CPU."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fastmamba


@pytest.fixture(scope="module")
def lm():
    return fastmamba.load()


def test_default_model_dir_holds_a_standard_checkpoint():
    folder = fastmamba.default_model_dir()
    assert isinstance(folder, Path)
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in folder.iterdir()}
    assert sum(p.stat().st_size for p in folder.iterdir()) <= 25 * 2**20


def test_transformers_loads_it_with_the_same_logits(lm):
    from transformers import MambaForCausalLM

    hf = MambaForCausalLM.from_pretrained(str(fastmamba.default_model_dir())).eval()
    ids = torch.tensor([lm.tokenizer.encode("To be, or not to be, that is the question:")])
    with torch.no_grad():
        ref = hf(ids).logits
    out = lm.forward(ids)
    assert ((out - ref).abs().max() / ref.abs().max()).item() < 1e-4


def test_it_writes_english_words(lm):
    text = lm.generate("To be, or not to be", max_tokens=48).text
    words = [w.strip(".,;:!?'\"[]-").lower() for w in text.split()]
    common = {"the", "and", "to", "of", "i", "a", "my", "you", "that", "in", "is", "not", "me", "it", "with", "be"}
    assert len(words) > 10 and sum(w in common for w in words) >= 3, text


def test_bf16_storage_mostly_agrees_with_float32(lm):
    bf16 = fastmamba.load(dtype="bfloat16")
    a = lm.generate("To be, or not to be", max_tokens=64, stop_token_ids=[]).token_ids
    b = bf16.generate("To be, or not to be", max_tokens=64, stop_token_ids=[]).token_ids
    prefix = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), 64)
    assert prefix >= 8, (a, b)  # greedy paths may part after a near tie, but not at once


def test_cli_uses_it_without_model_flag():
    r = subprocess.run(
        [sys.executable, "-m", "fastmamba.cli", "generate", "--max-tokens", "16", "To be, or not to be"],
        capture_output=True, text=True, timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout == fastmamba.load().generate("To be, or not to be", max_tokens=16).text + "\n"


def test_the_readme_python_snippet_runs_as_written(tmp_path):
    """The README's first Python block, pasted into a fresh interpreter on a CPU machine offline."""
    import os
    import re
    import subprocess
    import sys
    from pathlib import Path

    readme = (Path(__file__).parent.parent / "README.md").read_text()
    snippet = re.search(r"## Python\n\n```python\n(.*?)```", readme, re.S).group(1)
    assert "lm.forward(token_ids)" in snippet
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": ""}
    r = subprocess.run([sys.executable, "-c", snippet], capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip()  # the generated text and the fields printed
