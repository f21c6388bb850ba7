"""Times Mamba-2's chunked scan (kernels/ssd.py `ssd_scan`, bf16 operands, as a bf16
model's conv gives them) at the public shapes for several tiles of its chunk-scan kernel
(steps a program, steps a block of the sum, warps, pipeline stages), beside mamba_ssm's
`mamba_chunk_scan_combined` (if its source is on the path). The other three kernels take
the same time in every row, so the rows differ by the chunk scan's time. Chooses
SSDTiles' bt, bs, scan_warps and scan_stages (engine/plan.py's SSD_TILES).

    PYTHONPATH=.peer:. python -m benchmarks.tune_ssd_scan --models mamba2-2.7b,codestral-7b
"""

import argparse
import itertools
from dataclasses import replace

import torch
from triton.testing import do_bench

from fastmamba.engine.plan import SSD_TILES
from fastmamba.kernels import ssd

# name: (heads, head_dim, groups, d_state)
SHAPES = {"mamba2-130m": (24, 64, 1, 128), "mamba2-2.7b": (80, 64, 1, 128), "codestral-7b": (128, 64, 8, 128)}
TILES = ("bt", "bs", "scan_warps", "scan_stages")  # the SSDTiles fields swept


def inputs(B, T, H, P, G, N):
    g = torch.Generator(device="cuda").manual_seed(0)
    r = lambda *s: torch.randn(*s, device="cuda", generator=g)  # noqa: E731
    return dict(x=r(B, T, H, P).bfloat16(), dt=r(B, T, H) - 3, dt_bias=torch.zeros(H, device="cuda"),
                A=-torch.rand(H, device="cuda", generator=g) - 0.5, Bm=r(B, T, G, N).bfloat16(),
                Cm=r(B, T, G, N).bfloat16(), D=torch.ones(H, device="cuda"), state=torch.zeros(B, H, P, N, device="cuda"))


def scan_calls(v, chunk: int = 256, dt_limit=(0.0, float("inf")), tiles=SSD_TILES):
    """Our scan (with `tiles`) and mamba_ssm's `mamba_chunk_scan_combined` over `inputs`'
    tensors, as callables (theirs None where mamba_ssm's source is not on the path)."""
    def ours():
        return ssd.ssd_scan(v["x"], v["dt"], v["dt_bias"], dt_limit, v["A"], v["Bm"], v["Cm"], v["D"], v["state"], chunk,
                            tiles=tiles)

    try:
        from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined
    except Exception:
        return ours, None

    def theirs():
        return mamba_chunk_scan_combined(v["x"], v["dt"], v["A"], v["Bm"], v["Cm"], chunk, D=v["D"], dt_bias=v["dt_bias"],
                                         dt_softplus=True, return_final_states=True)
    return ours, theirs


def ours_ms(v, values):
    """ms a call of our scan with the plan's tiles but for TILES' `values`."""
    tiles = replace(SSD_TILES, **dict(zip(TILES, values)))
    return do_bench(scan_calls(v, tiles=tiles)[0], warmup=10, rep=50)


def peer_ms(v):
    theirs = scan_calls(v)[1]
    return None if theirs is None else do_bench(theirs, warmup=10, rep=50)


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--models", default=",".join(SHAPES))
    ap.add_argument("--passes", default="1x8192,8x2048")
    args = ap.parse_args()
    now = tuple(getattr(SSD_TILES, name) for name in TILES)
    grid = [t for t in itertools.product((64, 128), (32, 64), (4, 8), (1, 2, 3)) if t[1] <= t[0]]
    print(f"ms a layer's scan; tiles {TILES}, now {now}")
    for name, shape in itertools.product(args.models.split(","), args.passes.split(",")):
        B, T = map(int, shape.split("x"))
        v = inputs(B, T, *SHAPES[name])
        times = {t: ours_ms(v, t) for t in grid}
        best = min(times, key=times.get)
        peer = peer_ms(v)
        print(f"{name} {shape}: now {times[now]:.3f}; best {best} {times[best]:.3f}; "
              f"mamba_ssm {'-' if peer is None else f'{peer:.3f}'}")
        print("   " + " ".join(f"{'/'.join(map(str, t))}:{ms:.3f}" for t, ms in sorted(times.items())))


if __name__ == "__main__":
    main()
