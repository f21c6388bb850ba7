"""The examples run: a few updates of each, to catch breakage (not to show learning)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("gymnasium")
pytest.importorskip("matplotlib")

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def test_recurrent_ppo_runs_both_cores_and_writes_its_curve(tmp_path):
    out = tmp_path / "ppo"
    cmd = [sys.executable, str(EXAMPLES / "recurrent_ppo.py"), "--core", "mamba,lstm", "--total-steps", "1024",
           "--seeds", "2", "--envs", "4", "--rollout", "64", "--minibatches", "2", "--out", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    results = json.loads((out / "returns.json").read_text())
    assert set(results) == {"mamba", "lstm"} and all(set(seeds) == {"0", "1"} for seeds in results.values())
    for seeds in results.values():
        for curve in seeds.values():
            assert curve and all(steps > 0 and 1 <= ret <= 500 for steps, ret in curve)  # CartPole's returns
    assert (out / "curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "ms an update" in r.stdout
    # a second run for one core merges into the file, keeping the other core's
    r = subprocess.run(cmd[:3] + ["lstm", "--total-steps", "256", "--seeds", "1"] + cmd[8:], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    merged = json.loads((out / "returns.json").read_text())
    assert merged["mamba"] == results["mamba"] and set(merged["lstm"]) == {"0"}


def test_recurrent_ppo_refuses_an_unknown_core(tmp_path):
    r = subprocess.run([sys.executable, str(EXAMPLES / "recurrent_ppo.py"), "--core", "gru", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--core" in r.stderr


@pytest.mark.parametrize("args,message", [
    (["--envs", "0"], "argument --envs: a whole number > 0 is needed, got '0'"),
    (["--rollout", "-3"], "argument --rollout: a whole number > 0 is needed, got '-3'"),
    (["--envs", "4", "--minibatches", "8"], "--minibatches (8) must divide --envs (4)"),
    (["--lr", "0"], "argument --lr: a number > 0 is needed"),
    (["--device", "gpu0"], "--device takes cpu, cuda or cuda:N, got 'gpu0'"),
])
def test_recurrent_ppo_refuses_nonsensical_sizes_in_one_line(tmp_path, args, message):
    r = subprocess.run([sys.executable, str(EXAMPLES / "recurrent_ppo.py"), *args, "--out", str(tmp_path / "o")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith(f"recurrent_ppo.py: error: {message}")
    assert not (tmp_path / "o").exists()
