"""PPO with a recurrent policy on CartPole with its velocities hidden: the agent sees the
cart's position and the pole's angle only, so it must remember to act well. The recurrent
core is `fastmamba.Backbone` (`--core mamba`, or `--core mamba2` for its Mamba-2 layers) or
`torch.nn.LSTM` (`--core lstm`), with everything else equal: the same heads, rollouts, losses and settings.

Rollouts run the core a step at a time over a batch of environments, each row reset at its
own episode's start; each update trains on the rollout's sequences from their stored
starting state, with the same resets inside them (the Backbone's sequence pass, the LSTM
unrolled with its state zeroed at a reset).

    python examples/recurrent_ppo.py --core mamba,lstm --total-steps 50000 --seeds 3 --out ppo

writes ppo/returns.json ({core: {seed: [[env_steps, mean_return], ...]}}, merged with what
the file held for other cores) and ppo/curve.png (mean episode return against environment
steps, each core's seeds), and prints the wall time of each update.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import fastmamba  # noqa: E402

SEEN = [0, 2]  # CartPole's observation: cart position, cart velocity, pole angle, pole angular velocity


class Core(nn.Module):
    """The recurrent core, behind one interface: `step` (one observation a row, the state
    updated in place after zeroing the rows that start an episode) and `sequence` (a
    rollout's observations from its starting state, with the same starts). Kinds: mamba,
    mamba2 (fastmamba.Backbone), lstm, gru (torch's, unrolled; examples/popgym_ppo.py takes
    all four)."""

    def __init__(self, kind: str, obs_dim: int, width: int, layers: int, head_dim: int | None = None,
                 d_state: int | None = None):
        super().__init__()
        self.kind = kind
        if kind == "mamba":
            self.net = fastmamba.Backbone(fastmamba.BackboneConfig(input_dim=obs_dim, d_model=width, n_layer=layers))
        elif kind == "mamba2":  # the same Backbone, its layers Mamba-2's (heads of 32 channels where they fit)
            self.net = fastmamba.Backbone(fastmamba.BackboneConfig(
                input_dim=obs_dim, d_model=width, n_layer=layers, layer="mamba2",
                head_dim=head_dim or math.gcd(32, 2 * width), d_state=d_state or 64, chunk_size=64))
        elif kind in ("lstm", "gru"):
            self.net = (nn.LSTM if kind == "lstm" else nn.GRU)(obs_dim, width, num_layers=layers, batch_first=True)
            # the Backbone's features come out of its final RMSNorm, at unit scale; the LSTM's
            # come out tiny at its initialisation (~0.03), and without a norm of its own the
            # critic fits so slowly that PPO learned nothing in 100k steps (RESULTS.md)
            self.out_norm = nn.LayerNorm(width)
        else:
            raise ValueError(f"core: mamba, mamba2, lstm or gru, got {kind!r}")
        self.width, self.layers = width, layers
        self.mamba = kind in ("mamba", "mamba2")

    def new_state(self, batch: int, device):
        if self.mamba:
            return self.net.new_state(batch)
        # the torch RNN's state as a tuple: (h, c) for the LSTM, (h,) for the GRU
        return tuple(torch.zeros(self.layers, batch, self.width, device=device) for _ in range(1 + (self.kind == "lstm")))

    def copy(self, state):
        if self.mamba:
            return fastmamba.MambaState(state.conv.clone(), state.ssm.clone())
        return tuple(t.clone() for t in state)

    def rows(self, state, idx):
        if self.mamba:
            return fastmamba.MambaState(state.conv[:, idx], state.ssm[:, idx])
        return tuple(t[:, idx] for t in state)

    def _rnn(self, obs: torch.Tensor, state: tuple, keep: torch.Tensor):
        """The torch RNN over obs (B, t, obs_dim) from `state` with its rows scaled by keep (1, B, 1)."""
        state = tuple(t * keep for t in state)
        out, state = self.net(obs, state if self.kind == "lstm" else state[0])
        return out, (state if self.kind == "lstm" else (state,))

    def step(self, obs: torch.Tensor, state, starts: torch.Tensor):
        """obs (B, obs_dim), starts (B,) bool -> features (B, width); the state in place."""
        if self.mamba:
            state.reset(starts)
            return self.net.step(obs, state)
        out, new = self._rnn(obs[:, None], state, (~starts).float()[None, :, None])
        for t, n in zip(state, new):
            t.copy_(n)
        return self.out_norm(out[:, 0])

    def sequence(self, obs: torch.Tensor, state, starts: torch.Tensor) -> torch.Tensor:
        """obs (B, T, obs_dim) from `state`, starts (B, T) bool -> features (B, T, width)."""
        if self.mamba:
            return self.net(obs, state, resets=starts)[0]
        outs = []
        for t in range(obs.shape[1]):
            out, state = self._rnn(obs[:, t : t + 1], state, (~starts[:, t]).float()[None, :, None])
            outs.append(out)
        return self.out_norm(torch.cat(outs, 1))


class Agent(nn.Module):
    def __init__(self, core: Core, actions: int):
        super().__init__()
        self.core = core
        self.actor = nn.Linear(core.width, actions)
        self.critic = nn.Linear(core.width, 1)

    def heads(self, features: torch.Tensor):
        return torch.distributions.Categorical(logits=self.actor(features)), self.critic(features)[..., 0]


def make_envs(n: int, seed: int):
    import gymnasium as gym

    def one():
        env = gym.make("CartPole-v1")
        low, high = env.observation_space.low[SEEN], env.observation_space.high[SEEN]
        env = gym.wrappers.TransformObservation(env, lambda o: o[SEEN], gym.spaces.Box(low, high, dtype=np.float32))
        # scaled by a running mean and spread, for either core alike (the pole's angle is
        # ~10x smaller than the cart's position)
        return gym.wrappers.NormalizeObservation(env)

    envs = gym.vector.SyncVectorEnv([one for _ in range(n)], autoreset_mode=gym.vector.AutoresetMode.SAME_STEP)
    return gym.wrappers.vector.RecordEpisodeStatistics(envs)


def ppo(agent: Agent, envs, updates: int, seed: int, args):
    """PPO on `envs` (a gymnasium vector env with same-step autoreset and episode statistics,
    float observations (E, obs_dim)) for `updates` updates of `args.rollout` steps an env;
    yields after each update (environment steps so far, the returns of the episodes ended
    during it, its wall time in seconds)."""
    device = torch.device(args.device)
    opt = torch.optim.Adam(agent.parameters(), lr=args.lr, eps=1e-5)
    E, T = args.envs, args.rollout
    obs = torch.as_tensor(envs.reset(seed=seed)[0], device=device)
    starts = torch.ones(E, dtype=torch.bool, device=device)  # the first step of every env starts an episode
    state = agent.core.new_state(E, device)
    steps = 0
    for update in range(updates):
        t0 = time.perf_counter()
        for group in opt.param_groups:  # linear annealing of the learning rate
            group["lr"] = args.lr * (1 - update / updates)
        state0 = agent.core.copy(state)  # the rollout's starting state, which training starts from
        buf = {k: [] for k in ("obs", "starts", "actions", "logprobs", "values", "rewards", "dones")}
        finished = []
        with torch.no_grad():
            for _ in range(T):
                features = agent.core.step(obs, state, starts)
                dist, value = agent.heads(features)
                action = dist.sample()
                next_obs, reward, term, trunc, info = envs.step(action.cpu().numpy())  # (ended ones reset at once)
                done = np.logical_or(term, trunc)
                for k, v in (("obs", obs), ("starts", starts), ("actions", action), ("logprobs", dist.log_prob(action)),
                             ("values", value)):
                    buf[k].append(v)
                buf["rewards"].append(torch.as_tensor(reward, dtype=torch.float32, device=device))
                buf["dones"].append(torch.as_tensor(done, dtype=torch.float32, device=device))
                if "episode" in info:
                    finished += [float(r) for r, ok in zip(info["episode"]["r"], info["_episode"]) if ok]
                obs = torch.as_tensor(next_obs, device=device)
                starts = torch.as_tensor(done, device=device)
                steps += E
            last_value = agent.heads(agent.core.step(obs, agent.core.copy(state), starts))[1]
        b = {k: torch.stack(v, 1) for k, v in buf.items()}  # (E, T), actions (E, T, k) for k categorical heads
        # generalised advantage estimates, backwards in time; an episode's end (termination
        # or truncation alike, as CleanRL does) cuts them
        adv = torch.zeros(E, T, device=device)
        running = torch.zeros(E, device=device)
        for t in reversed(range(T)):
            next_value = b["values"][:, t + 1] if t + 1 < T else last_value
            go_on = 1 - b["dones"][:, t]
            delta = b["rewards"][:, t] + args.gamma * next_value * go_on - b["values"][:, t]
            running = delta + args.gamma * args.gae_lambda * go_on * running
            adv[:, t] = running
        returns = adv + b["values"]
        for _ in range(args.epochs):
            for idx in torch.randperm(E, device=device).chunk(args.minibatches):
                features = agent.core.sequence(b["obs"][idx], agent.core.rows(state0, idx), b["starts"][idx])
                dist, value = agent.heads(features)
                logprob = dist.log_prob(b["actions"][idx])
                ratio = torch.exp(logprob - b["logprobs"][idx])
                a = adv[idx]
                a = (a - a.mean()) / (a.std() + 1e-8)
                policy_loss = torch.max(-a * ratio, -a * ratio.clamp(1 - args.clip, 1 + args.clip)).mean()
                value_loss = 0.5 * (value - returns[idx]).pow(2).mean()
                loss = policy_loss + args.vf_coef * value_loss - args.ent_coef * dist.entropy().mean()
                opt.zero_grad()
                loss.backward()
                nn.utils.clip_grad_norm_(agent.parameters(), args.max_grad_norm)
                opt.step()
        yield steps, finished, time.perf_counter() - t0


def train(core_kind: str, seed: int, args) -> list[list[float]]:
    """One run: [[env steps, mean return of the episodes ended since the last point], ...]."""
    torch.manual_seed(seed)
    np.random.seed(seed)
    envs = make_envs(args.envs, seed)
    agent = Agent(Core(core_kind, len(SEEN), args.width, args.layers, args.head_dim, args.d_state),
                  envs.single_action_space.n).to(args.device)
    updates = max(1, args.total_steps // (args.envs * args.rollout))
    curve, finished = [], []
    for update, (steps, ended, seconds) in enumerate(ppo(agent, envs, updates, seed, args)):
        finished += ended
        if finished:
            curve.append([steps, float(np.mean(finished))])
            finished = []
        last = curve[-1][1] if curve else float("nan")
        print(f"{core_kind} seed {seed} update {update + 1}/{updates}: {steps} steps, return {last:.1f}, "
              f"{seconds * 1e3:.0f} ms an update", flush=True)
    envs.close()
    return curve


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    colors = {"mamba": "tab:blue", "mamba2": "tab:green", "lstm": "tab:orange"}
    for core, seeds in results.items():
        for k, (seed, curve) in enumerate(sorted(seeds.items())):
            if curve:
                x, y = zip(*curve)
                ax.plot(x, y, color=colors.get(core), alpha=0.8, label=core if k == 0 else None)
    ax.set_xlabel("environment steps")
    ax.set_ylabel("mean episode return")
    ax.set_title("Recurrent PPO, CartPole without velocities")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def positive(kind, zero: bool = False):
    """An argparse type: a number of `kind` (int or float) above 0, or from 0 with `zero`."""
    rule = f"{'a whole number' if kind is int else 'a number'} {'>= 0' if zero else '> 0'}"

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not np.isfinite(value) or value < 0 or (value == 0 and not zero):
            raise argparse.ArgumentTypeError(f"{rule} is needed, got {text!r}")
        return value

    return parse


def fraction(text: str) -> float:
    """An argparse type: a number from 0 to 1."""
    try:
        value = float(text)
    except ValueError:
        value = None
    if value is None or not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"a number from 0 to 1 is needed, got {text!r}")
    return value


def names(text: str) -> list[str]:
    """A comma-separated flag's names (--core, --task), blanks dropped."""
    return [x.strip() for x in text.split(",") if x.strip()]


def add_ppo_arguments(ap: argparse.ArgumentParser, envs: int) -> None:
    """The flags of the agent and of PPO, shared with the other examples that train with `ppo`."""
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--envs", type=positive(int), default=envs)
    ap.add_argument("--rollout", type=positive(int), default=128, help="steps a rollout (the training sequences' length)")
    ap.add_argument("--width", type=positive(int), default=64, help="the core's width (d_model, or the LSTM's hidden size)")
    ap.add_argument("--layers", type=positive(int), default=1)
    ap.add_argument("--head-dim", type=positive(int), help="mamba2: channels a head (default 32 where it divides "
                    "2 x width): each head has one decay rate, so smaller heads give the layer more of them")
    ap.add_argument("--d-state", type=positive(int), help="mamba2: states a channel (default 64)")
    ap.add_argument("--lr", type=positive(float), default=1e-3)
    ap.add_argument("--epochs", type=positive(int), default=4)
    ap.add_argument("--minibatches", type=positive(int), default=4, help="minibatches an epoch, split by environment")
    ap.add_argument("--gamma", type=fraction, default=0.99)
    ap.add_argument("--gae-lambda", type=fraction, default=0.95)
    ap.add_argument("--clip", type=positive(float), default=0.2)
    ap.add_argument("--ent-coef", type=positive(float, zero=True), default=0.01)
    ap.add_argument("--vf-coef", type=positive(float, zero=True), default=0.5)
    ap.add_argument("--max-grad-norm", type=positive(float), default=0.5)


def check_ppo_arguments(ap: argparse.ArgumentParser, args) -> None:
    """What argparse's types can't check alone, each an argparse error before anything runs."""
    if args.head_dim and (2 * args.width) % args.head_dim:
        ap.error(f"--head-dim ({args.head_dim}) must divide the Mamba-2 layer's 2 x --width ({2 * args.width})")
    if args.envs % args.minibatches:
        ap.error(f"--minibatches ({args.minibatches}) must divide --envs ({args.envs})")
    if args.envs // args.minibatches * args.rollout < 2:  # (their spread normalises them)
        ap.error(f"a minibatch holds --envs / --minibatches x --rollout = "
                 f"{args.envs // args.minibatches * args.rollout} advantages: it needs 2 at least")
    try:
        device = torch.device(args.device)
    except RuntimeError:
        ap.error(f"--device takes cpu, cuda or cuda:N, got {args.device!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error(f"--device {args.device}: PyTorch sees no CUDA GPU here")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--core", default="mamba,lstm", help="mamba, mamba2, lstm, or several comma-separated")
    ap.add_argument("--total-steps", type=positive(int), default=50_000, help="environment steps a run")
    ap.add_argument("--seeds", type=positive(int), default=3, help="runs a core, seeds 0 .. K-1")
    ap.add_argument("--out", default="ppo", help="folder for returns.json and curve.png")
    add_ppo_arguments(ap, envs=8)
    args = ap.parse_args()
    cores = names(args.core)
    if not cores or any(c not in ("mamba", "mamba2", "lstm") for c in cores):
        ap.error(f"--core takes mamba, mamba2, lstm or several of them, got {args.core!r}")
    check_ppo_arguments(ap, args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "returns.json"
    results = json.loads(path.read_text()) if path.exists() else {}
    for core in cores:
        results[core] = {str(seed): train(core, seed, args) for seed in range(args.seeds)}
        path.write_text(json.dumps(results))
    plot(results, out / "curve.png")
    print(f"wrote {path} and {out / 'curve.png'}")


if __name__ == "__main__":
    main()
