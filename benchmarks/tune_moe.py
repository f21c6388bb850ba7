"""Times the fused MoE layer's routed experts (kernels/moe.py `moe_ffn_triton`: the grouping,
gate and up, down, the picks' sum) at the public experts' shapes for several tiles, bf16
experts, against the floor: the active experts' weights read once at the copy rate (a token's
k experts; at larger batches the distinct experts the routing picks), uniform routing.
Chooses engine/plan.py's MOE_TILES: one MoETiles for a decode step's few tokens, one for a
prefill chunk's many (a token's bits depend on the tiles, so the deterministic step keeps
the first at every batch).

    python -m benchmarks.tune_moe --tokens 1,64,8192
"""

import argparse
import itertools
from dataclasses import replace

import torch
from triton.testing import do_bench

from fastmamba.bench import copy_bandwidth
from fastmamba.engine.plan import MOE_TILES
from fastmamba.kernels.moe import moe_ffn_triton

# name: (experts, d_model, expert width, picks a token, activation, gated)
SHAPES = {"granite-4.0-h-tiny": (64, 1536, 512, 6, "silu", True),
          "nemotron-3-nano-30b-a3b": (128, 2688, 1856, 6, "relu2", False)}


def case(E, d, I, k, gated, N):
    g = torch.Generator(device="cuda").manual_seed(0)
    in_w = (torch.randn(E, (2 if gated else 1) * I, d, device="cuda", generator=g) * d**-0.5).to(torch.bfloat16)
    out_w = (torch.randn(E, d, I, device="cuda", generator=g) * I**-0.5).to(torch.bfloat16)
    x = torch.randn(N, d, device="cuda", generator=g).to(torch.bfloat16)
    top, experts = torch.randn(N, E, device="cuda", generator=g).topk(k, dim=-1)
    return x, experts, torch.softmax(top, dim=-1), in_w, out_w


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tokens", default="1,64,8192")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    args = ap.parse_args()
    rate = copy_bandwidth()  # (bytes a second)
    sweep = [(bm, bn, bk, w) for bm, bn, bk, w in itertools.product((16, 64), (32, 64, 128), (64, 128), (4, 8))]
    print(f"{torch.cuda.get_device_name()}, copy {rate / 1e12:.2f} TB/s; the plan's tiles first: {MOE_TILES}")
    for name in args.shapes.split(","):
        E, d, I, k, act, gated = SHAPES[name]
        for N in (int(n) for n in args.tokens.split(",")):
            x, experts, weights, in_w, out_w = case(E, d, I, k, gated, N)
            active = experts.unique().numel()
            floor_us = active * (in_w[0].numel() + out_w[0].numel()) * 2 / rate * 1e6
            plan = MOE_TILES.for_tokens(N)
            candidates = [plan] + [replace(plan, bm=bm, bn=bn, bk=bk, warps=w) for bm, bn, bk, w in sweep
                                   if (bm, bn, bk, w) != (plan.bm, plan.bn, plan.bk, plan.warps)]
            rows = []
            for t in candidates:
                try:
                    us = do_bench(lambda: moe_ffn_triton(x, experts, weights, in_w, out_w, act, gated, tiles=t),
                                  warmup=10, rep=50) * 1e3
                except Exception as e:  # (a tile the shape or the shared memory cannot take)
                    print(f"  {t}: {type(e).__name__}")
                    continue
                rows.append((us, t))
            rows.sort(key=lambda r: r[0])
            plan_us = next(us for us, t in rows if t == plan)
            print(f"{name} N={N}: {active} experts active, floor {floor_us:.1f} us; the plan's {plan_us:.1f} us "
                  f"({floor_us / plan_us:.2f} of the floor)")
            for us, t in rows[:5]:
                print(f"  {us:8.1f} us ({floor_us / us:.2f})  bm={t.bm} bn={t.bn} bk={t.bk} warps={t.warps}")


if __name__ == "__main__":
    main()
