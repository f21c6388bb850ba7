"""HuggingFace hub ids (`org/name`) load from the local cache, laid out here by the test in
huggingface_hub's own layout (blobs, snapshots/<commit>, refs/main), with no network."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fastmamba

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def lay_out_cache(hf_home: Path, repo_id: str, checkpoint: Path) -> Path:
    """Puts `checkpoint`'s files into an HF cache under hf_home as a download would leave them."""
    repo = hf_home / "hub" / ("models--" + repo_id.replace("/", "--"))
    (repo / "blobs").mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    snapshot = repo / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    for f in checkpoint.iterdir():
        data = f.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / f.name).symlink_to(os.path.relpath(blob, snapshot))
    return snapshot


def run(code: str, hf_home: Path, offline: bool, cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env["HF_HOME"] = str(hf_home)
    if offline:
        env["HF_HUB_OFFLINE"] = "1"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env, cwd=cwd)


LOGITS = """
import sys, torch, fastmamba
lm = fastmamba.load(sys.argv[1] if len(sys.argv) > 1 else {repo!r})
torch.save(lm.forward(torch.tensor([[1, 5, 7, 2]])), {out!r})
print(lm.path)
"""


@pytest.mark.parametrize("offline", [True, False])
def test_hub_id_loads_from_the_cache(tmp_path, text_checkpoint, offline):
    snapshot = lay_out_cache(tmp_path / "hf", "tiny-org/mamba-tiny", text_checkpoint)
    out = tmp_path / "logits.pt"
    # Not offline: the cache is asked first, so no request leaves (this machine has no network).
    r = run(LOGITS.format(repo="tiny-org/mamba-tiny", out=str(out)), tmp_path / "hf", offline)
    assert r.returncode == 0, r.stderr
    assert Path(r.stdout.strip()).resolve() == snapshot.resolve()
    expected = fastmamba.load(text_checkpoint).forward(torch.tensor([[1, 5, 7, 2]]))
    assert torch.equal(torch.load(out), expected)


def test_cli_takes_a_hub_id(tmp_path, text_checkpoint):
    lay_out_cache(tmp_path / "hf", "tiny-org/mamba-tiny", text_checkpoint)
    code = "from fastmamba.cli import main\nraise SystemExit(main(['generate', '--model', 'tiny-org/mamba-tiny', '--max-tokens', '6', 'To be']))"
    r = run(code, tmp_path / "hf", offline=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout == fastmamba.load(text_checkpoint).generate("To be", max_tokens=6).text + "\n"


def test_a_folder_of_that_name_wins(tmp_path, text_checkpoint, checkpoints):
    lay_out_cache(tmp_path / "hf", "tiny-org/mamba-tiny", text_checkpoint)
    import shutil

    shutil.copytree(checkpoints["odd_vocab_tied"], tmp_path / "tiny-org" / "mamba-tiny")
    r = run("import fastmamba; print(fastmamba.load('tiny-org/mamba-tiny').config.vocab_size)", tmp_path / "hf",
            offline=True, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "101"  # the folder's model (the cached one has the tokenizer's vocabulary)


def test_offline_and_not_cached_is_one_clear_error(tmp_path):
    (tmp_path / "hf").mkdir()
    r = run("import fastmamba; fastmamba.load('tiny-org/not-here')", tmp_path / "hf", offline=True)
    assert r.returncode != 0
    last = r.stderr.strip().splitlines()[-1]
    assert "CheckpointError" in last and "tiny-org/not-here" in last and "HF_HUB_OFFLINE" in last
    code = "from fastmamba.cli import main\nraise SystemExit(main(['generate', '--model', 'tiny-org/not-here', 'hi']))"
    r = run(code, tmp_path / "hf", offline=True)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "tiny-org/not-here" in r.stderr and "not in the HuggingFace cache" in r.stderr


def test_version_flag():
    r = subprocess.run([sys.executable, "-m", "fastmamba.cli", "--version"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == f"fastmamba {fastmamba.__version__}"
