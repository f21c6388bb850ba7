"""Times Mamba-2's chunked-scan state passing alone (kernels/ssd.py
`_ssd_state_passing_kernel`) at the public shapes for several tiles (state elements a
program, chunks a load, warps), beside mamba_ssm's `_state_passing_fwd` (if its source is
on the path) and the floor: the per-chunk states read once in float32 and the states the
chunks start from written once in bf16 (both sides write them in the operands' dtype), at
the copy rate. Chooses SSDTiles' pass_bl, pass_cb and pass_warps (engine/plan.py's SSD_TILES).

    PYTHONPATH=.peer:. python -m benchmarks.tune_ssd_pass --models mamba2-2.7b,codestral-7b
"""

import argparse
import itertools

import torch
import triton
from triton.testing import do_bench

from fastmamba.bench import copy_bandwidth
from fastmamba.engine.plan import SSD_TILES
from fastmamba.kernels import ssd

# name: (heads, head_dim, d_state)
SHAPES = {"mamba2-130m": (24, 64, 128), "mamba2-2.7b": (80, 64, 128), "codestral-7b": (128, 64, 128)}


def ours_us(B, T, H, P, N, BL, CB, warps):
    Q = SSD_TILES.chunk
    n_chunks = triton.cdiv(T, Q)
    states = torch.randn(B, n_chunks, H, P, N, device="cuda")
    starts = torch.empty(B, n_chunks, H, P, N, device="cuda", dtype=torch.bfloat16)
    layer = torch.randn(B, H, P, N, device="cuda")
    cum = -torch.rand(B, n_chunks, Q, H, device="cuda").cumsum(2)

    def run():
        ssd._ssd_state_passing_kernel[(triton.cdiv(P * N, BL), H, B)](
            states, starts, layer, cum, cum, T, n_chunks, H=H, PN=P * N, Q=Q, BL=BL,
            CB=min(CB, triton.next_power_of_2(n_chunks)), RESETS=False, num_warps=warps)
    return do_bench(run, warmup=10, rep=50) * 1e3


def peer_us(B, T, H, P, N):
    try:
        from mamba_ssm.ops.triton.ssd_state_passing import _state_passing_fwd
    except Exception:
        return None
    n_chunks = triton.cdiv(T, SSD_TILES.chunk)
    states = torch.randn(B, n_chunks, H, P * N, device="cuda")
    dA = -torch.rand(B, H, n_chunks, device="cuda")
    init = torch.randn(B, H, P * N, device="cuda")
    return do_bench(lambda: _state_passing_fwd(states, dA, initial_states=init, out_dtype=torch.bfloat16),
                    warmup=10, rep=50) * 1e3


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--models", default=",".join(SHAPES))
    ap.add_argument("--passes", default="1x8192,8x2048")
    args = ap.parse_args()
    rate = copy_bandwidth()
    print(f"copy rate {rate / 1e12:.2f} TB/s; µs a layer's state passing (floor: the chunks' states read once, "
          "float32, and their starts written once, bf16)")
    for name, shape in itertools.product(args.models.split(","), args.passes.split(",")):
        H, P, N = SHAPES[name]
        B, T = map(int, shape.split("x"))
        floor = B * triton.cdiv(T, SSD_TILES.chunk) * H * P * N * (4 + 2) / rate * 1e6
        times = {(bl, cb, w): ours_us(B, T, H, P, N, bl, cb, w)
                 for bl in (64, 128, 256, 512) for cb in (8, 16, 32) for w in (2, 4, 8) if bl * cb <= 8192}
        best = min(times, key=times.get)
        now = (SSD_TILES.pass_bl, SSD_TILES.pass_cb, SSD_TILES.pass_warps)
        peer = peer_us(B, T, H, P, N)
        print(f"{name} {shape}: floor {floor:.1f}; now {now} {times.get(now, float('nan')):.1f}; "
              f"best {best} {times[best]:.1f} ({floor / times[best]:.0%} of floor); "
              f"mamba_ssm {'-' if peer is None else f'{peer:.1f}'}")
        print("   " + " ".join(f"{bl}/{cb}/{w}:{t:.0f}" for (bl, cb, w), t in sorted(times.items())))


if __name__ == "__main__":
    main()
