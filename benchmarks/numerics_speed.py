"""What the numerical contract's choices cost or save in decode (docs/architecture.md):
whole graph-replayed steps, ms, three variants of the same random model in one process:

- halves:   the products' 16-bit operands as two halves (split16.py), out_proj's rounded
            once (the plan before the contract: DecodePlan.halves = all but out_proj)
- once:     every operand rounded once (the default plan), float32 state
- bf16 st.: rounded once, the state stored in bfloat16 (load(state_dtype="bfloat16"))

Order A B C C B A, means of the two. Also the floor of each (weights once, the state read
and written, at the copy rate measured here).

    python -m benchmarks.numerics_speed --models 2.8b,130m --batches 1,32,128,256,512
"""

import argparse
import dataclasses
import json
from pathlib import Path

import torch

from fastmamba import bench
from fastmamba.core.model import Mamba
from fastmamba.engine.plan import ALL, plan_for


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="2.8b,130m")
    ap.add_argument("--batches", default="1,32,128,256,512")
    ap.add_argument("--json")
    args = ap.parse_args()
    bw = bench.copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}, copy {bw / 1e12:.2f} TB/s; ms a step (tokens/s), of floor")
    rows = []
    for size in args.models.split(","):
        model = bench.random_model(size, torch.bfloat16)
        bf16_state = Mamba(model.config, model.weights, model.ops, state_dtype=torch.bfloat16)
        for batch in map(int, args.batches.split(",")):
            plan = plan_for(model.config, torch.bfloat16, batch)
            old = dataclasses.replace(plan, halves=ALL - {"out_proj"})
            variants = {"halves": (model, old), "once": (model, plan), "bf16 st.": (bf16_state, plan)}
            times = bench.time_graph_steps_abba(variants, batch)
            line = f"{size:>5} batch {batch:>4} ({plan.step}):"
            for k, (m, p) in variants.items():
                ms = times[k]
                floor = bench.floor_ms(m, batch, bw)
                rows.append(dict(model=size, batch=batch, variant=k, ms=round(ms, 4), floor_ms=round(floor, 4)))
                line += f"  {k} {ms:.3f} ({batch * 1e3 / ms:.0f}) {floor / ms:.2f}"
            print(line, flush=True)
        del model, bf16_state
        torch.cuda.empty_cache()
    if args.json:
        Path(args.json).write_text(json.dumps(dict(device=torch.cuda.get_device_name(), copy_tbs=bw / 1e12, rows=rows), indent=2))


if __name__ == "__main__":
    main()
