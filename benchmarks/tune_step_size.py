"""Times the step-size GEMM (kernels/step_size.py) at public prefill shapes for several
tile shapes, warps and pipeline depths, against cuBLAS's dt_proj alone (the same product
and output without bias and softplus), to choose StepSizeTiles' bm, bn, warps and stages
(engine/plan.py's STEP_SIZE_TILES).

    python -m benchmarks.tune_step_size
"""

import itertools
from dataclasses import replace

import torch
from triton.testing import do_bench

from fastmamba.engine.plan import STEP_SIZE_TILES
from fastmamba.kernels import step_size as st
from fastmamba.kernels.products import linear_storage


def main() -> None:
    for M, R, E in ((4096, 160, 5120), (16384, 160, 5120), (8192, 48, 1536)):
        g = torch.Generator(device="cuda").manual_seed(0)
        dbc = torch.randn(M, R + 32, device="cuda", generator=g)
        dt_r = dbc[None, :, :R]
        w = (torch.randn(E, R, device="cuda", generator=g) / R**0.5).to(torch.bfloat16)
        bias = torch.randn(E, device="cuda", generator=g) - 4
        cublas = do_bench(lambda: linear_storage(dt_r, w), warmup=5, rep=50) * 1e3
        print(f"M={M} R={R} E={E}: cuBLAS dt_proj alone {cublas:7.1f} us (f32 out: {M * E * 4 / cublas / 1e6:.2f} TB/s)", flush=True)
        ref = st.step_size(dt_r, w, bias, tiles=STEP_SIZE_TILES)
        res = []
        for BM, BN, warps, stages in itertools.product((32, 64, 128), (64, 128, 256), (4, 8), (1, 2, 3)):
            if BM * BN // (32 * warps) > 128:  # over 128 accumulators a thread
                continue
            tiles = replace(STEP_SIZE_TILES, bm=BM, bn=BN, warps=warps, stages=stages)
            us = do_bench(lambda t=tiles: st.step_size(dt_r, w, bias, tiles=t), warmup=5, rep=50) * 1e3
            same = torch.equal(st.step_size(dt_r, w, bias, tiles=tiles), ref)
            res.append((us, BM, BN, warps, stages, same))
        for us, BM, BN, warps, stages, same in sorted(res)[:6]:
            print(f"   BM={BM:3d} BN={BN:3d} warps={warps} stages={stages}: {us:7.1f} us  {'same' if same else 'DIFFERENT'}", flush=True)


if __name__ == "__main__":
    main()
