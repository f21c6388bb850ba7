"""What sampling costs in a decode step, at the public vocabulary (50280): the sampler alone
in a graph (sampling.sample, the torch oracle, against the one `generate` picks:
sampling.pick_sampler), and whole graph-replayed steps with the picked sampler.

    python -m benchmarks.sampling_speed           # --alone: the sampler alone only
"""

import argparse

import torch

from fastmamba.bench import random_model, time_graph_launches, time_graph_steps
from fastmamba.core.sampling import SlotParams, pick_sampler, sample
from fastmamba.core.sampling_params import SamplingParams
from fastmamba.engine.plan import SAMPLER_TILES

V = 50280
SETTINGS = {
    "greedy": SamplingParams(),
    "temperature 0.8": SamplingParams(temperature=0.8),
    "temperature 0.8, top-p 0.95": SamplingParams(temperature=0.8, top_p=0.95),
    "temperature 0.7, top-k 40, repetition 1.1": SamplingParams(temperature=0.7, top_k=40, repetition_penalty=1.1),
    "temperature 1.0, top-k 50, top-p 0.9": SamplingParams(temperature=1.0, top_k=50, top_p=0.9),
    "temperature 1.5, top-p 0.99 (flat)": SamplingParams(temperature=1.5, top_p=0.99),
}


def time_sampler(pick, params, batch):
    """µs a call of the sampler alone (10 calls a graph)."""
    slots = SlotParams.empty(batch, V, "cuda")
    slots.set_slots([(params, 1, [1, 2, 3])] * batch)
    logits = torch.randn(batch, V, device="cuda") * 3
    return time_graph_launches([lambda: pick(logits, slots)] * 10, reps=50)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--alone", action="store_true", help="the sampler alone only, no whole steps")
    args = ap.parse_args()
    print(torch.cuda.get_device_name(), flush=True)
    for batch in (1, 32, 128):
        for name, params in SETTINGS.items():
            pick = pick_sampler([params], True, SAMPLER_TILES)
            torch_us, picked_us = time_sampler(sample, params, batch), time_sampler(pick, params, batch)
            print(f"sampler alone, batch {batch:3d}, {name}: sample {torch_us:7.1f} us, {pick.__name__} {picked_us:7.1f} us", flush=True)
    if args.alone:
        return
    for size in ("130m", "2.8b"):
        model = random_model(size, torch.bfloat16)
        for batch in (1, 32):
            for name, params in SETTINGS.items():
                ms = time_graph_steps(model, batch, params=params)
                print(f"{size} batch {batch:3d}, {name}: {ms:.4f} ms/step", flush=True)
        del model


if __name__ == "__main__":
    main()
