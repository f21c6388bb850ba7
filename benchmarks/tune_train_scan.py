"""Times the training scan (kernels/scan_grad.py) forward + backward at the Backbone's
benchmark shapes for several tiles (steps a chunk, channels a program, warps), to choose
TrainScanTiles (engine/plan.py's TRAIN_SCAN_TILES).

    python -m benchmarks.tune_train_scan
"""

import itertools

import torch
from triton.testing import do_bench

from fastmamba.kernels import scan_grad
from fastmamba.kernels.scan_grad import TrainScanTiles

# (B, T, E): 128 x 3 at 16 x 1024, 512 x 4 at 64 x 256; N 16, dt_rank 8 and 32
SHAPES = [(16, 1024, 256, 8), (64, 256, 1024, 32)]


def scan_pass(B: int, T: int, E: int, R: int, N: int = 16):
    """The training scan's forward + backward alone at one layer's shapes, as a callable of
    the tiles: x, z and the step sizes channels-contiguous and B, C views of x_proj's
    output, as the layer makes them; resets at 1/64."""
    def g(*s):
        return torch.randn(*s, device="cuda").requires_grad_(True)

    def btE():
        return torch.randn(B, T, E, device="cuda").transpose(1, 2).requires_grad_(True)

    x, z, dt_r, xbc = btE(), btE(), g(B, T, R), g(B, T, 2 * N)
    Bm, Cm = xbc[..., :N].transpose(1, 2), xbc[..., N:].transpose(1, 2)
    dt_w, bias, D = g(E, R), g(E), g(E)
    A = (-torch.rand(E, N, device="cuda") - 0.1).requires_grad_(True)
    resets = torch.rand(B, T, device="cuda") < 1 / 64

    def run(tiles: TrainScanTiles):
        s = torch.zeros(B, E, N, device="cuda")
        scan_grad.step_and_scan_train(x, dt_r, dt_w, bias, A, Bm, Cm, D, z, s, resets=resets, tiles=tiles).sum().backward()

    return run


def main() -> None:
    for B, T, E, R in SHAPES:
        run = scan_pass(B, T, E, R)
        for BT, BE, warps in itertools.product((16, 32), (4, 8, 16), (2, 4, 8)):
            tiles = TrainScanTiles(bt=BT, be=BE, warps=warps)
            try:
                ms = do_bench(lambda run=run, t=tiles: run(t), warmup=5, rep=40)
            except Exception as err:  # (a tile too large for the registers or shared memory)
                print(f"B{B} T{T} E{E}  BT {BT:2d} BE {BE:2d} warps {warps}: {type(err).__name__}", flush=True)
                continue
            print(f"B{B} T{T} E{E}  BT {BT:2d} BE {BE:2d} warps {warps}: {ms:.3f} ms", flush=True)


if __name__ == "__main__":
    main()
