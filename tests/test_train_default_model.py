"""The training script's CPU smoke test: tiny settings, a few steps, a loadable checkpoint."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

import fastmamba

SCRIPT = Path(__file__).resolve().parents[1] / "tools" / "train_default_model.py"


def test_tiny_training_run_writes_a_checkpoint_both_engines_load(tmp_path):
    from transformers import MambaForCausalLM

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(3):
        (corpus / f"work{i}.txt").write_text(("Shall I compare thee to a summer's day? " * 40 + f"Work {i}.\n") * 3)
    out = tmp_path / "model"
    r = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(out), "--preset", "tiny", "--steps", "3", "--corpus", str(corpus), "--device", "cpu"],
        capture_output=True, text=True, timeout=300,
    )
    assert r.returncode == 0, r.stderr
    assert "step     1" in r.stdout and "held-out perplexity" in r.stdout
    report = json.loads((out / "report.json").read_text())
    assert report["steps"] == 3 and report["heldout_perplexity"] > 1

    lm = fastmamba.load(out)
    ids = torch.tensor([lm.tokenizer.encode("Shall I compare thee")])
    hf = MambaForCausalLM.from_pretrained(str(out)).eval()
    with torch.no_grad():
        ref = hf(ids).logits
    assert ((lm.forward(ids) - ref).abs().max() / ref.abs().max()).item() < 1e-4
