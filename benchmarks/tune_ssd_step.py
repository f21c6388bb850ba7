"""Times Mamba-2's decode-step state update alone (kernels/ssd.py `_ssd_step_kernel`) at the
public shapes for several tiles (channels a program, warps) and both state dtypes, beside
mamba_ssm's `selective_state_update` (if its source is on the path) and the floor: the
state read and written once at the copy rate. Chooses SSDTiles' step_bp and step_warps
(engine/plan.py's SSD_TILES).

    PYTHONPATH=.peer:. python -m benchmarks.tune_ssd_step --batches 1,128
"""

import argparse
import itertools

import torch
import triton
from triton.testing import do_bench

from fastmamba.bench import copy_bandwidth
from fastmamba.engine.plan import SSD_TILES
from fastmamba.kernels import ssd

# name: (heads, head_dim, d_state, groups, layers)
SHAPES = {"mamba2-130m": (24, 64, 128, 1, 24), "mamba2-2.7b": (80, 64, 128, 1, 64), "codestral-7b": (128, 64, 128, 8, 64)}


def inputs(B, H, P, N, G, state_dtype):
    """One layer's step operands as the layer makes them: x, B, C bf16 views of the conv's
    output, dt a float32 view of in_proj's."""
    xbc = torch.randn(B, H * P + 2 * G * N, device="cuda").to(torch.bfloat16)
    x, Bm, Cm = xbc.split([H * P, G * N, G * N], dim=-1)
    dt = torch.randn(B, 2 * H * P + H, device="cuda")[:, -H:]
    state = (torch.randn(B, H, P, N, device="cuda") * 0.1).to(state_dtype)
    A = -torch.rand(H, device="cuda") - 0.5
    return x.unflatten(-1, (H, P)), dt, Bm.unflatten(-1, (G, N)), Cm.unflatten(-1, (G, N)), state, A


def ours_us(B, H, P, N, G, state_dtype, BP, warps):
    x, dt, Bm, Cm, state, A = inputs(B, H, P, N, G, state_dtype)
    dt_bias, D = torch.zeros(H, device="cuda"), torch.ones(H, device="cuda")
    y = torch.empty(B, 1, H, P, device="cuda")

    def run():
        ssd._ssd_step_kernel[(triton.cdiv(P, BP), H, B)](
            x, x.stride(0), Bm, Cm, Bm.stride(0), dt, dt.stride(0), dt_bias, A, D, state, y, H // G, 0.0, float("inf"),
            H=H, P=P, N=N, BP=BP, NP=triton.next_power_of_2(N), num_warps=warps)
    return do_bench(run, warmup=25, rep=100) * 1e3


def peer_us(B, H, P, N, G, state_dtype):
    try:
        from mamba_ssm.ops.triton.selective_state_update import selective_state_update
    except Exception:
        return None
    x, dt, Bm, Cm, state, A = inputs(B, H, P, N, G, state_dtype)
    # its Mamba2.step's call: per-head scalars broadcast over the head's channels and states
    A3 = A[:, None, None].expand(H, P, N)
    dt3 = dt[:, :, None].expand(B, H, P)
    bias = torch.zeros(H, device="cuda")[:, None].expand(H, P)
    D = torch.ones(H, device="cuda")[:, None].expand(H, P)
    return do_bench(lambda: selective_state_update(state, x, dt3, A3, Bm, Cm, D, z=None, dt_bias=bias, dt_softplus=True),
                    warmup=25, rep=100) * 1e3


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--models", default=",".join(SHAPES))
    ap.add_argument("--batches", default="1,128")
    args = ap.parse_args()
    rate = copy_bandwidth()
    print(f"copy rate {rate / 1e12:.2f} TB/s; µs a layer's state update (floor: the state read and written once)")
    for name, B, sd in itertools.product(args.models.split(","), map(int, args.batches.split(",")),
                                          (torch.float32, torch.bfloat16)):
        H, P, N, G, _ = SHAPES[name]
        floor = 2 * B * H * P * N * sd.itemsize / rate * 1e6
        times = {(bp, w): ours_us(B, H, P, N, G, sd, bp, w) for bp in (4, 8, 16, 32) for w in (1, 2, 4, 8)}
        best = min(times, key=times.get)
        now = (SSD_TILES.step_bp, SSD_TILES.step_warps)
        peer = peer_us(B, H, P, N, G, sd)
        print(f"{name} b{B} {str(sd)[6:]}: floor {floor:.1f}; now {now} {times.get(now, float('nan')):.1f}; "
              f"best {best} {times[best]:.1f} ({floor / times[best]:.0%} of floor); "
              f"mamba_ssm {'-' if peer is None else f'{peer:.1f}'}")
        print("   " + " ".join(f"{bp}/{w}:{t:.0f}" for (bp, w), t in sorted(times.items())))


if __name__ == "__main__":
    main()
