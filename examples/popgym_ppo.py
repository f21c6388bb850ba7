"""Recurrent PPO on POPGym's memory tasks (Morad et al., ICLR 2023): the agent must remember
what it saw to act well, so the tasks rank memory cores. The core is `fastmamba.Backbone`
(`--core mamba`, `--core mamba2`) or torch's LSTM or GRU (`--core lstm`, `--core gru`),
everything else equal: the PPO loop, heads and settings are examples/recurrent_ppo.py's.

    python examples/popgym_ppo.py --task RepeatPreviousEasy,CountRecallEasy --core mamba,lstm \\
        --seeds 3 --updates 100 --out popgym

writes popgym/returns.json ({task: {core: {seed: {"steps": [...], "returns": [...],
"seconds": [...]}}}}, one entry an update: environment steps so far, the mean return of the
episodes that ended during the update (null where none did), its wall time; merged with
what the file held for other tasks, cores and seeds) and popgym/<task>.png (the mean return over
seeds against updates, shaded from the lowest seed to the highest, a line a core).
POPGym scales each episode's return into [-1, 1].
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import torch
from recurrent_ppo import Agent, Core, add_ppo_arguments, check_ppo_arguments, names, positive, ppo

# The tasks taken, by their spaces (popgym 1.0.7; each at Easy, Medium and Hard, which
# change the sizes and episode lengths, not the kinds of space):
#   observation Discrete, one-hot: RepeatPrevious, RepeatFirst (4 cards; action Discrete(4)),
#     HigherLower (13; Discrete(2)), MultiarmedBandit (2; Discrete(10-30)),
#     Battleship (2; action MultiDiscrete([8-12] x 2)), MineSweeper (3-10; MultiDiscrete([4-8] x 2))
#   observation Tuple of Discretes, one one-hot each: Autoencode (Discrete(2), Discrete(4); Discrete(4))
#   observation MultiDiscrete, one one-hot a component: CountRecall ([2 2] to [13 13];
#     Discrete(27) or (17)), Concentration (52 or 104 cards of 3-14 values; Discrete(52) or (104))
#   observation Box, flattened and normalised by a running mean and spread: PositionOnlyCartPole,
#     NoisyPositionOnlyCartPole, VelocityOnlyCartPole (2 floats; Discrete(2))
# Left out: the pendulums (Box actions: a Gaussian head is not the categorical heads the cores
# are compared with here) and the labyrinths (they need mazelib, which popgym does not require).
TASKS = ["RepeatPrevious", "RepeatFirst", "Autoencode", "CountRecall", "HigherLower", "Concentration",
         "MultiarmedBandit", "Battleship", "MineSweeper", "PositionOnlyCartPole", "NoisyPositionOnlyCartPole",
         "VelocityOnlyCartPole"]
LEVELS = ["Easy", "Medium", "Hard"]
DEFAULT_TASKS = [t + level for t in ("RepeatPrevious", "Autoencode", "CountRecall", "PositionOnlyCartPole")
                 for level in ("Easy", "Medium")]
CORES = ["mamba", "mamba2", "lstm", "gru"]


def encoder(space):
    """(width, encode): `encode` maps an observation of `space` to a float32 vector of `width`
    (a one-hot a Discrete or MultiDiscrete component, a Box flattened, a Tuple's parts joined)."""
    import gymnasium as gym

    if isinstance(space, gym.spaces.Discrete):
        n, start = int(space.n), int(space.start)

        def one_hot(o):
            v = np.zeros(n, np.float32)
            v[int(o) - start] = 1
            return v

        return n, one_hot
    if isinstance(space, gym.spaces.MultiDiscrete):
        nvec, start = space.nvec.ravel(), space.start.ravel()
        offsets = np.concatenate([[0], np.cumsum(nvec)[:-1]])
        width = int(nvec.sum())

        def one_hots(o):
            v = np.zeros(width, np.float32)
            v[offsets + np.asarray(o).ravel() - start] = 1
            return v

        return width, one_hots
    if isinstance(space, gym.spaces.Box):
        return int(np.prod(space.shape)), lambda o: np.asarray(o, np.float32).ravel()
    if isinstance(space, gym.spaces.Tuple):
        parts = [encoder(s) for s in space.spaces]
        return sum(w for w, _ in parts), lambda o: np.concatenate([f(x) for (_, f), x in zip(parts, o)])
    raise ValueError(f"no encoding for observation space {space}")


def action_sizes(space) -> list[int]:
    """The categorical heads' sizes: one for Discrete, one a component for MultiDiscrete."""
    import gymnasium as gym

    if isinstance(space, gym.spaces.Discrete) and space.start == 0:
        return [int(space.n)]
    if isinstance(space, gym.spaces.MultiDiscrete) and space.nvec.ndim == 1 and not space.start.any():
        return [int(n) for n in space.nvec]
    raise ValueError(f"no categorical heads for action space {space}")


class Categoricals:
    """Independent categorical distributions, one a MultiDiscrete component: an action is
    (..., k); its log-probability and entropy are the components' sums."""

    def __init__(self, logits: torch.Tensor, sizes: list[int]):
        self.parts = [torch.distributions.Categorical(logits=x) for x in logits.split(sizes, -1)]

    def sample(self) -> torch.Tensor:
        return torch.stack([p.sample() for p in self.parts], -1)

    def log_prob(self, action: torch.Tensor) -> torch.Tensor:
        return sum(p.log_prob(action[..., i]) for i, p in enumerate(self.parts))

    def entropy(self) -> torch.Tensor:
        return sum(p.entropy() for p in self.parts)


class PopgymAgent(Agent):
    """recurrent_ppo's agent with a categorical head a component of the action."""

    def __init__(self, core: Core, sizes: list[int]):
        super().__init__(core, sum(sizes))
        self.sizes = sizes

    def heads(self, features: torch.Tensor):
        if len(self.sizes) == 1:
            return super().heads(features)
        return Categoricals(self.actor(features), self.sizes), self.critic(features)[..., 0]


def make_envs(task: str, n: int):
    import gymnasium as gym
    import popgym.envs

    cls = getattr(popgym.envs, task)
    width, encode = encoder(cls().observation_space)

    def one():
        env = cls()
        box = isinstance(env.observation_space, gym.spaces.Box)
        env = gym.wrappers.TransformObservation(env, encode, gym.spaces.Box(-np.inf, np.inf, (width,), np.float32))
        return gym.wrappers.NormalizeObservation(env) if box else env

    # same-step autoreset: a step that ends an episode returns the next episode's first
    # observation, and the PPO loop marks that env's next step as a start (the core's reset)
    envs = gym.vector.SyncVectorEnv([one for _ in range(n)], autoreset_mode=gym.vector.AutoresetMode.SAME_STEP)
    return gym.wrappers.vector.RecordEpisodeStatistics(envs)


def train(task: str, core_kind: str, seed: int, args) -> dict[str, list]:
    """One run: {"steps", "returns", "seconds"}, an entry an update."""
    torch.manual_seed(seed)
    np.random.seed(seed)
    envs = make_envs(task, args.envs)
    sizes = action_sizes(envs.single_action_space)
    core = Core(core_kind, envs.single_observation_space.shape[0], args.width, args.layers, args.head_dim, args.d_state)
    agent = PopgymAgent(core, sizes).to(args.device)
    run = {"steps": [], "returns": [], "seconds": []}
    for update, (steps, ended, seconds) in enumerate(ppo(agent, envs, args.updates, seed, args)):
        mean = float(np.mean(ended)) if ended else None
        run["steps"].append(steps)
        run["returns"].append(mean)
        run["seconds"].append(seconds)
        if not args.quiet:
            shown = "-" if mean is None else f"{mean:+.3f}"
            print(f"{task} {core_kind} seed {seed} update {update + 1}/{args.updates}: return {shown}, "
                  f"{seconds:.2f} s/update", flush=True)
    envs.close()
    return run


COLORS = {"mamba": "tab:blue", "mamba2": "tab:green", "lstm": "tab:orange", "gru": "tab:red"}


def draw(ax, task: str, cores: dict) -> None:
    """One task's curves on `ax`: the mean return over seeds against updates, shaded from the
    lowest seed to the highest, a line a core."""
    per_update = set()
    for core, seeds in cores.items():
        per_update |= {run["steps"][0] for run in seeds.values() if run["steps"]}
        curves = [[np.nan if r is None else r for r in run["returns"]] for run in seeds.values()]
        n = min(len(c) for c in curves)
        if n == 0:
            continue
        y = np.array([c[:n] for c in curves])  # (seeds, updates)
        x = np.arange(1, n + 1)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # an update where no seed ended an episode
            mean, low, high = np.nanmean(y, 0), np.nanmin(y, 0), np.nanmax(y, 0)
        ended = ~np.isnan(mean)  # (episodes longer than a rollout end in some updates only: joined over the rest)
        ax.plot(x[ended], mean[ended], color=COLORS.get(core),
                label=f"{core} ({len(curves)} seed{'s' * (len(curves) > 1)})")
        ax.fill_between(x[ended], low[ended], high[ended], color=COLORS.get(core), alpha=0.2)
    ax.set_xlabel("PPO update" + (f" ({per_update.pop()} environment steps each)" if len(per_update) == 1 else ""))
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_ylabel("mean episode return")
    ax.set_title(f"Recurrent PPO, POPGym {task}")
    ax.legend()


def plot(results: dict, path: Path, cols: int = 1, dpi: int = 120) -> None:
    """One PNG of a panel a task ({task: {core: {seed: run}}}), `cols` panels a row."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = -(-len(results) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(7 * cols, 4.5 * rows), squeeze=False)
    for ax, (task, cores) in zip(axes.flat, sorted(results.items())):
        draw(ax, task, cores)
    for ax in axes.flat[len(results):]:
        ax.set_visible(False)
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--task", default=",".join(DEFAULT_TASKS),
                    help=f"POPGym tasks, comma-separated: one of {', '.join(TASKS)} followed by Easy, Medium or Hard")
    ap.add_argument("--core", default=",".join(CORES), help="mamba, mamba2, lstm, gru, or several comma-separated")
    ap.add_argument("--seeds", type=positive(int), default=3, help="runs a task and core, seeds 0 .. K-1")
    ap.add_argument("--first-seed", type=positive(int, zero=True), default=0,
                    help="start the seeds here (seeds S .. S+K-1): runs of one task split over processes")
    budget = ap.add_mutually_exclusive_group()
    budget.add_argument("--updates", type=positive(int), help="PPO updates a run (default 100)")
    budget.add_argument("--steps", type=positive(int),
                        help="environment steps a run instead, over all envs (updates = steps / (envs x rollout))")
    ap.add_argument("--out", default="popgym", help="folder for returns.json and a <task>.png each")
    ap.add_argument("--quiet", action="store_true", help="no line an update")
    add_ppo_arguments(ap, envs=64)
    args = ap.parse_args()
    tasks, cores = names(args.task), names(args.core)
    known = {t + level for t in TASKS for level in LEVELS}
    unknown = [t for t in tasks if t not in known]
    if not tasks or unknown:
        ap.error(f"--task: unknown {', '.join(map(repr, unknown)) or 'nothing'}; "
                 f"one of {', '.join(TASKS)} followed by Easy, Medium or Hard")
    if not cores or any(c not in CORES for c in cores):
        ap.error(f"--core takes mamba, mamba2, lstm, gru or several of them, got {args.core!r}")
    check_ppo_arguments(ap, args)
    args.updates = args.updates or (max(1, args.steps // (args.envs * args.rollout)) if args.steps else 100)
    for package in ("gymnasium", "popgym", "matplotlib"):
        try:
            __import__(package)
        except ImportError:
            print(f"popgym_ppo.py: error: {package} is not installed: pip install 'fastmamba[examples]'",
                  file=sys.stderr)
            sys.exit(2)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "returns.json"
    results = json.loads(path.read_text()) if path.exists() else {}
    t0 = time.perf_counter()
    for task in tasks:
        for core in cores:
            results.setdefault(task, {}).setdefault(core, {})
            for seed in range(args.first_seed, args.first_seed + args.seeds):
                results[task][core][str(seed)] = train(task, core, seed, args)
                path.write_text(json.dumps(results))
        plot({task: results[task]}, out / f"{task}.png")
    print(f"wrote {path} and {', '.join(str(out / f'{t}.png') for t in tasks)} "
          f"({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
