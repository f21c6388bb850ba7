"""Times the prefill conv kernel alone at 2.8b widths for several block shapes and loop
settings, to choose kernels/causal_conv1d.py's ConvTiles (engine/plan.py's CONV_TILES).
Prints µs a call and the rate at which it moves its bytes (x read and y written once, both
in bfloat16, as a bf16 model's prefill runs it: model.in_proj_dtype).

    python -m benchmarks.tune_conv
"""

import itertools

import torch
from triton.testing import do_bench

from fastmamba.engine.plan import CONV_TILES
from fastmamba.kernels import causal_conv1d as cc


def main() -> None:
    for B, T, E in ((1, 8192, 5120), (8, 2048, 5120)):
        xz = torch.randn(B, T, 2 * E, device="cuda").to(torch.bfloat16)
        x = xz[..., :E].transpose(1, 2)  # as the model passes it: in_proj's x half
        w, b = torch.randn(E, 4, device="cuda"), torch.randn(E, device="cuda")
        state = torch.randn(B, E, 4, device="cuda")
        state0 = state.clone()
        nbytes = B * T * E * (2 + 2)
        # (each call updates the conv state it is given: the checks start from the same one)
        ref = cc.causal_conv1d(x, w, b, state0.clone(), None, torch.bfloat16, tiles=CONV_TILES).float()
        rows = []
        # (a program walks BT steps, each thread `per` neighbouring channels of BE)
        for BE, per, BT, stages, unroll in itertools.product((128, 256, 512), (2, 4), (8, 16, 32), (1, 2, 3), (1, 2, 4)):
            warps = BE // (32 * per)
            tiles = cc.ConvTiles(be=BE, bt=BT, warps=warps, stages=stages, unroll=unroll)
            us = do_bench(lambda t=tiles: cc.causal_conv1d(x, w, b, state, None, torch.bfloat16, tiles=t), warmup=3, rep=20) * 1e3
            err = (cc.causal_conv1d(x, w, b, state0.clone(), None, torch.bfloat16, tiles=tiles).float() - ref).abs().max().item()
            rows.append((us, BE, BT, warps, stages, unroll, err))
        print(f"B={B} T={T} E={E} ({nbytes / 1e6:.0f} MB moved):", flush=True)
        for us, BE, BT, warps, stages, unroll, err in sorted(rows)[:8]:
            print(f"   BE={BE:3d} BT={BT:3d} warps={warps} stages={stages} unroll={unroll}: {us:7.1f} us  "
                  f"{nbytes / us / 1e6:4.2f} TB/s  (max diff {err:.1e})", flush=True)


if __name__ == "__main__":
    main()
