"""What a constrained (structured output) slot costs the batch it runs in, on the GPU.

The engine core (engine/engine_core.py) in this process, with random weights at a public
shape: `--batch` requests decode together (no stop tokens, so none ends), of which 0, 1, 8
or all are guided. It times the engine's steps (wall ms a step over many steps), the
unguided batch beside. A guided request costs the batch three things: the host fills its
token bitmask each step (xgrammar, on the step's critical path: the mask needs the step
before's token), the mask goes to the GPU and is applied before sampling, and while any
request is guided the engine takes no step ahead (each step's tokens are read before the
next step starts).

The guide is a regular expression (`--regex`, lowercase words) over the bundled model's
tokenizer (the shape's logits past its vocabulary are empty tokens). A request's stop token
is one of those, with a logit bias of -100 on every request (guided or not: one sampler for
all), so none ends inside the window; should one end all the same, another like it takes
its place (a prefill inside the window: the count is reported).

    python -m benchmarks.guided_cost --models 130m,2.8b --batch 64 --json guided.json
"""

import argparse
import json
import time

import torch

from fastmamba.bench import random_language_model
from fastmamba.core.sampling_params import SamplingParams
from fastmamba.engine.engine_core import EngineCore
from fastmamba.engine.protocol import Request
from fastmamba.io.folders import default_model_dir


def step_ms(lm, batch: int, guided: int, regex: str, steps: int) -> float:
    V = lm.config.vocab_size
    core = EngineCore(lm.model, lm.prefill, max_batch=batch, prefill_tokens=4096,
                      tokenizer=default_model_dir() / "tokenizer.json")
    stop = len(json.loads((default_model_dir() / "tokenizer.json").read_text())["model"]["vocab"])
    g = torch.Generator().manual_seed(0)
    made = 0

    def add(is_guided: bool) -> None:
        nonlocal made
        ids = torch.randint(1, V, (32,), generator=g).tolist()
        core.add(Request(made, ids, SamplingParams(max_tokens=100_000, temperature=0.8, seed=made,
                                                   stop_token_ids=[stop], logit_bias={stop: -100.0},
                                                   guide=("regex", regex) if is_guided else None)))
        made += 1

    for k in range(batch):
        add(k < guided)
    for _ in range(20):  # admitted, prefilled, decoding (grammars compiled)
        core.step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    replaced = 0
    for _ in range(steps):
        core.step()
        while len(core.requests) < batch:  # (a request like the one that ended)
            add(sum(r.params.guide is not None for r in core.requests.values()) < guided)
            replaced += 1
    torch.cuda.synchronize()
    ms = (time.perf_counter() - t0) / steps * 1e3
    for r in list(core.requests.values()):
        core.abort(r.rid)
    while core.has_work:
        core.step()
    return ms, replaced


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="130m,2.8b")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--guided", default="0,1,8,64", help="how many of the batch are guided, each case")
    ap.add_argument("--regex", default="[a-z]+( [a-z]+)*")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--json")
    args = ap.parse_args()
    device = torch.cuda.get_device_name()
    print(device, flush=True)
    rows = []
    for size in args.models.split(","):
        lm = random_language_model(size, torch.bfloat16)
        base = None
        for guided in [int(n) for n in args.guided.split(",")]:
            guided = min(guided, args.batch)
            ms, replaced = step_ms(lm, args.batch, guided, args.regex, args.steps)
            base = ms if guided == 0 else base
            row = dict(model=size, batch=args.batch, guided=guided, step_ms=round(ms, 3),
                       vs_unguided=round(ms / base, 3) if base else None, replaced=replaced)
            rows.append(row)
            print(json.dumps(row), flush=True)
        del lm
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=device, regex=args.regex, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
