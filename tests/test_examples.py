"""The examples run: a few updates of each, to catch breakage (not to show learning)."""

from __future__ import annotations

import json
import os
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
    (["--envs", "4", "--minibatches", "4", "--rollout", "1"],
     "a minibatch holds --envs / --minibatches x --rollout = 1 advantages: it needs 2 at least"),
    (["--lr", "0"], "argument --lr: a number > 0 is needed"),
    (["--device", "gpu0"], "--device takes cpu, cuda or cuda:N, got 'gpu0'"),
])
def test_recurrent_ppo_refuses_nonsensical_sizes_in_one_line(tmp_path, args, message):
    r = subprocess.run([sys.executable, str(EXAMPLES / "recurrent_ppo.py"), *args, "--out", str(tmp_path / "o")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith(f"recurrent_ppo.py: error: {message}")
    assert not (tmp_path / "o").exists()


POPGYM = EXAMPLES / "popgym_ppo.py"


def test_popgym_ppo_runs_a_task_for_two_cores_and_writes_its_curves(tmp_path):
    pytest.importorskip("popgym")
    out = tmp_path / "popgym"
    cmd = [sys.executable, str(POPGYM), "--task", "RepeatPreviousEasy", "--updates", "2", "--seeds", "1",
           "--envs", "8", "--rollout", "64", "--minibatches", "2", "--out", str(out)]
    r = subprocess.run(cmd + ["--core", "mamba"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    lines = [line for line in r.stdout.splitlines() if line.endswith("s/update")]
    assert [line.split(":")[0] for line in lines] == [f"RepeatPreviousEasy mamba seed 0 update {u}/2" for u in (1, 2)]
    # a second run, quiet, of the next seed for another core and the first merges into the file
    r = subprocess.run(cmd + ["--core", "lstm,mamba", "--first-seed", "1", "--quiet"], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    assert "s/update" not in r.stdout and r.stdout.startswith("wrote ")
    results = json.loads((out / "returns.json").read_text())
    assert list(results) == ["RepeatPreviousEasy"] and set(results["RepeatPreviousEasy"]) == {"mamba", "lstm"}
    assert sorted(results["RepeatPreviousEasy"]["mamba"]) == ["0", "1"]
    assert list(results["RepeatPreviousEasy"]["lstm"]) == ["1"]
    for run in (run for seeds in results["RepeatPreviousEasy"].values() for run in seeds.values()):
        assert set(run) == {"steps", "returns", "seconds"}
        assert run["steps"] == [8 * 64, 2 * 8 * 64]
        # every env ends an episode (51 steps) in each 64-step rollout; POPGym's returns lie in [-1, 1]
        assert len(run["returns"]) == 2 and all(isinstance(x, float) and -1 <= x <= 1 for x in run["returns"])
        assert len(run["seconds"]) == 2 and all(0 < s < 300 for s in run["seconds"])
    assert (out / "RepeatPreviousEasy.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_popgym_ppo_encodes_observations_and_samples_multidiscrete_actions():
    gym = pytest.importorskip("gymnasium")
    import torch

    sys.path.insert(0, str(EXAMPLES))
    try:
        import popgym_ppo
    finally:
        sys.path.remove(str(EXAMPLES))
    width, encode = popgym_ppo.encoder(gym.spaces.Tuple((gym.spaces.Discrete(2), gym.spaces.Discrete(4))))
    assert width == 6 and encode((1, 2)).tolist() == [0, 1, 0, 0, 1, 0]
    width, encode = popgym_ppo.encoder(gym.spaces.MultiDiscrete([2, 3]))
    assert width == 5 and encode([1, 0]).tolist() == [0, 1, 1, 0, 0]
    width, encode = popgym_ppo.encoder(gym.spaces.Box(-1, 1, (2, 3)))
    assert width == 6 and encode(torch.arange(6.0).reshape(2, 3).numpy()).tolist() == [0, 1, 2, 3, 4, 5]
    assert popgym_ppo.action_sizes(gym.spaces.Discrete(27)) == [27]
    assert popgym_ppo.action_sizes(gym.spaces.MultiDiscrete([8, 8])) == [8, 8]
    with pytest.raises(ValueError, match="no categorical heads"):
        popgym_ppo.action_sizes(gym.spaces.Box(-2, 2, (1,)))
    logits = torch.randn(5, 3 + 4)
    dist = popgym_ppo.Categoricals(logits, [3, 4])
    action = dist.sample()
    assert action.shape == (5, 2) and (action[:, 0] < 3).all() and (action[:, 1] < 4).all()
    first, second = logits[:, :3].log_softmax(-1), logits[:, 3:].log_softmax(-1)
    expected = first.gather(1, action[:, :1])[:, 0] + second.gather(1, action[:, 1:])[:, 0]
    torch.testing.assert_close(dist.log_prob(action), expected)
    entropy = -(first.exp() * first).sum(-1) - (second.exp() * second).sum(-1)
    torch.testing.assert_close(dist.entropy(), entropy)


@pytest.mark.parametrize("args,message", [
    (["--task", "RepeatPreviousEasy,Pong"], "--task: unknown 'Pong'; one of RepeatPrevious, "),
    (["--task", "PositionOnlyPendulumEasy"], "--task: unknown 'PositionOnlyPendulumEasy'"),
    (["--core", "mamba,transformer"], "--core takes mamba, mamba2, lstm, gru or several of them"),
    (["--updates", "2", "--steps", "100"], "argument --steps: not allowed with argument --updates"),
    (["--envs", "64", "--minibatches", "5"], "--minibatches (5) must divide --envs (64)"),
    (["--head-dim", "48"], "--head-dim (48) must divide the Mamba-2 layer's 2 x --width (128)"),
    (["--first-seed", "-1"], "argument --first-seed: a whole number >= 0 is needed, got '-1'"),
])
def test_popgym_ppo_refuses_an_unknown_task_or_core_in_one_line(tmp_path, args, message):
    r = subprocess.run([sys.executable, str(POPGYM), *args, "--out", str(tmp_path / "o")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith(f"popgym_ppo.py: error: {message}")
    assert not (tmp_path / "o").exists()


def test_popgym_ppo_without_popgym_says_what_to_install(tmp_path):
    (tmp_path / "popgym.py").write_text("raise ModuleNotFoundError(\"No module named 'popgym'\", name='popgym')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, str(POPGYM), "--task", "RepeatPreviousEasy", "--out", str(tmp_path / "o")],
                       capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 2
    assert r.stderr.strip() == "popgym_ppo.py: error: popgym is not installed: pip install 'fastmamba[examples]'"
    assert not (tmp_path / "o").exists()


def test_popgym_table_merges_folders_and_gives_each_core_its_final_return(tmp_path):
    def write(folder, results):
        folder.mkdir()
        (folder / "returns.json").write_text(json.dumps(results))

    def run(returns, seconds=1.0):
        return {"steps": [512 * (i + 1) for i in range(len(returns))], "returns": returns,
                "seconds": [seconds] * len(returns)}

    # seed 0 of each core in one folder, seed 1 of mamba in another; the final return is the
    # mean of the last 10 updates that ended an episode
    write(tmp_path / "a", {"RepeatPreviousEasy": {"mamba": {"0": run([-1.0] * 5 + [0.5] * 10)},
                                                  "lstm": {"0": run([0.1] * 9 + [None, 0.3], seconds=2.0)}}})
    write(tmp_path / "b", {"RepeatPreviousEasy": {"mamba": {"1": run([0.7] * 12)}}})
    r = subprocess.run([sys.executable, str(EXAMPLES / "popgym_table.py"), str(tmp_path / "a"), str(tmp_path / "b"),
                        "--out", str(tmp_path / "all"), "--grid", str(tmp_path / "grid.png")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    rows = [line.split(" | ") for line in r.stdout.splitlines() if line.startswith("| RepeatPreviousEasy")]
    assert [row[1:] for row in rows] == [["mamba", "2", "**+0.600 (+0.500 / +0.700)**", "12/15", "1.00 |"],
                                         ["lstm", "1", "+0.122", "11", "2.00 |"]]
    merged = json.loads((tmp_path / "all" / "returns.json").read_text())
    assert sorted(merged["RepeatPreviousEasy"]["mamba"]) == ["0", "1"]
    for png in (tmp_path / "all" / "RepeatPreviousEasy.png", tmp_path / "grid.png"):
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # a rerun (the same returns, other wall times) is the same run; with other returns, refused, named
    write(tmp_path / "d", {"RepeatPreviousEasy": {"lstm": {"0": run([0.1] * 9 + [None, 0.3], seconds=3.0)}}})
    r = subprocess.run([sys.executable, str(EXAMPLES / "popgym_table.py"), str(tmp_path / "a"), str(tmp_path / "d"),
                        "--out", str(tmp_path / "all"), "--no-plots"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "| RepeatPreviousEasy | lstm | 1 | +0.122 | 11 | 2.00 |" in r.stdout
    write(tmp_path / "c", {"RepeatPreviousEasy": {"lstm": {"0": run([0.9] * 10)}}})
    r = subprocess.run([sys.executable, str(EXAMPLES / "popgym_table.py"), str(tmp_path / "a"), str(tmp_path / "c"),
                        "--out", str(tmp_path / "all"), "--no-plots"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "RepeatPreviousEasy lstm seed 0 is in two folders" in r.stderr
    # a core whose runs ended no episode in their last updates: "-", and no other core's bold lost
    write(tmp_path / "e", {"RepeatPreviousEasy": {"gru": {"0": run([None] * 12), "1": run([None] * 12)}}})
    r = subprocess.run([sys.executable, str(EXAMPLES / "popgym_table.py"), str(tmp_path / "a"), str(tmp_path / "e"),
                        "--out", str(tmp_path / "all"), "--no-plots"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "| RepeatPreviousEasy | gru | 2 | - | 12 |" in r.stdout
    assert "| RepeatPreviousEasy | mamba | 1 | **+0.500** |" in r.stdout and "nan" not in r.stdout


def test_the_mamba2_core_takes_its_head_width():
    sys.path.insert(0, str(EXAMPLES))
    try:
        import recurrent_ppo
    finally:
        sys.path.remove(str(EXAMPLES))
    assert recurrent_ppo.Core("mamba2", 4, 64, 1).net.config.head_dim == 32  # the default: 4 heads
    narrow = recurrent_ppo.Core("mamba2", 4, 64, 1, head_dim=8).net
    assert narrow.config.head_dim == 8 and narrow.layers[0].mixer.A_log.shape == (16,)  # 16 heads, a decay each
