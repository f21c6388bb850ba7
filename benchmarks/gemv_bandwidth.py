"""How close the batch-1 GEMVs come to the memory's read rate, each kernel alone.

For the public shapes of in_proj and out_proj (1.4b, 2.8b), bf16, it captures one CUDA graph
of LAYERS launches, each on its own copy of the weights (together several times L2, so
every launch reads from memory, as in a real step), and reports µs a launch and TB/s for:

- read:    a kernel that only streams the matrix (sums each row): the ceiling;
- cublas:  torch.mv;
- engine:  decode_step's kernel with the engine's blocks (in_proj: rmsnorm_linear;
           out_proj: out_proj_residual, split over K);
- gemv:    a plain GEMV over a grid of blocks, with the product summed across threads once
           at the end (ACC2D) or in every K step (as the engine's kernels do), split over K.

    python benchmarks/gemv_bandwidth.py
    python benchmarks/gemv_bandwidth.py --engine   # without the plain GEMV's sweep
"""

import itertools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from fastmamba.bench import time_graph_launches  # noqa: E402
from fastmamba.engine.plan import one_row_blocks  # noqa: E402
from fastmamba.kernels import decode_step as ds  # noqa: E402

LAYERS = 24
SHAPES = {"1.4b in_proj": (8192, 2048), "1.4b out_proj": (2048, 4096), "2.8b in_proj": (10240, 2560), "2.8b out_proj": (2560, 5120)}


@triton.jit
def _read_kernel(w_ptr, out_ptr, NOUT, D, BN: tl.constexpr, BK: tl.constexpr):
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    acc = tl.zeros([BN, BK], dtype=tl.float32)
    for k0 in range(0, D, BK):
        k = k0 + tl.arange(0, BK)
        acc += tl.load(w_ptr + n[:, None] * D + k[None, :], mask=(n < NOUT)[:, None] & (k < D)[None, :], other=0.0).to(tl.float32)
    tl.store(out_ptr + n, tl.sum(acc, 1), mask=n < NOUT)


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, out_ptr, NOUT, D, KCHUNK, BN: tl.constexpr, BK: tl.constexpr, ACC2D: tl.constexpr):
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    s = tl.program_id(1)
    k_end = tl.minimum(s * KCHUNK + KCHUNK, D)
    if ACC2D:
        acc2 = tl.zeros([BN, BK], dtype=tl.float32)
    else:
        acc = tl.zeros([BN], dtype=tl.float32)
    for k0 in range(s * KCHUNK, k_end, BK):
        k = k0 + tl.arange(0, BK)
        km = k < k_end
        w = tl.load(w_ptr + n[:, None] * D + k[None, :], mask=(n < NOUT)[:, None] & km[None, :], other=0.0)
        x = tl.load(x_ptr + k, mask=km, other=0.0)
        if ACC2D:
            acc2 += w.to(tl.float32) * x[None, :]
        else:
            acc += tl.sum(w.to(tl.float32) * x[None, :], 1)
    if ACC2D:
        acc = tl.sum(acc2, 1)
    tl.store(out_ptr + s * NOUT + n, acc, mask=n < NOUT)


def main() -> None:
    print(torch.cuda.get_device_name(), triton.__version__, flush=True)
    for name, (nout, d) in SHAPES.items():
        ws = [torch.randn(nout, d, device="cuda").to(torch.bfloat16) for _ in range(LAYERS)]
        nbytes = nout * d * 2
        x = torch.randn(d, device="cuda")
        x16 = x.to(torch.bfloat16)
        out = torch.empty(16, nout, device="cuda")
        rows = []

        def add(label, launch, ws=ws):
            us = time_graph_launches([lambda w=w: launch(w) for w in ws])
            rows.append((us, label))

        for BN, BK in ((16, 512), (8, 1024), (32, 256)):
            add(f"read BN={BN} BK={BK}", lambda w, BN=BN, BK=BK: _read_kernel[(triton.cdiv(nout, BN),)](w, out, nout, d, BN=BN, BK=BK, num_warps=4))
        add("cublas mv", lambda w: torch.mv(w, x16))
        if "in_proj" in name:
            h = torch.randn(1, d, device="cuda")
            dh = torch.zeros(1, d, device="cuda", dtype=torch.int64)
            nw = torch.ones(d, device="cuda")
            default = one_row_blocks(d, nout // 2, 50280, torch.bfloat16).in_proj
            for (BN, BK, warps, stages), sum_last in itertools.product(
                    (default, (8, 512, 4, 1), (8, 256, 4, 1), (16, 256, 4, 1), (8, 1024, 8, 1)), (False, True)):
                add(f"engine rmsnorm_linear {(BN, BK, warps, stages)}{' default' if (BN, BK, warps, stages) == default else ''}"
                    f" sum_last={sum_last}",
                    lambda w, BN=BN, BK=BK, warps=warps, stages=stages, sl=sum_last: ds._rmsnorm_linear_kernel[(1, triton.cdiv(nout, BN))](
                        h, dh, nw, w, w, out, *(out,) * 6, dh, 1, d, nout, 0, 0, 1e-5, HAS_BIAS=False,
                        CONV=False, ARGMAX=False, K=4, KP=4, HAS_CB=False, BN=BN, BK=BK, BJ=16, STAGES=stages,
                        SUM_LAST=sl, UNROLL=1, PDL=0, num_warps=warps))
        else:
            y = torch.randn(1, d, device="cuda")
            dh = torch.zeros(1, nout, device="cuda", dtype=torch.int64)
            dbc = torch.zeros(1, 16, device="cuda", dtype=torch.int64)
            *blocks, programs = one_row_blocks(nout, 2 * nout, 50280, torch.bfloat16).out_proj
            default = (tuple(blocks), programs)
            for (BN, BK, warps), programs in (default, ((8, 512, 4), 1280), ((8, 256, 4), 1280), ((16, 512, 8), 1280)):
                nt = triton.cdiv(nout, BN)
                ns = max(1, min(programs // nt, triton.cdiv(d, BK)))
                kchunk = triton.cdiv(triton.cdiv(d, ns), BK) * BK
                ns = triton.cdiv(d, kchunk)
                add(f"engine out_proj {(BN, BK, warps)} splits={ns}{' default' if ((BN, BK, warps), programs) == default else ''}",
                    lambda w, BN=BN, BK=BK, warps=warps, nt=nt, ns=ns, kc=kchunk: ds._out_proj_residual_kernel[(1, nt, ns)](
                        y, w, w, dh, dbc, 1, nout, d, kc, HAS_BIAS=False, BN=BN, BK=BK, BJ=16, PDL=0, num_warps=warps))
        for BN, BK, warps, splits, acc2d in () if "--engine" in sys.argv else itertools.product((8, 16, 32), (256, 512, 1024), (4, 8), (1, 2, 4), (0, 1)):
            if BN * BK > 16384 or BN * BK < 2048 or triton.cdiv(nout, BN) * splits < 264:
                continue
            kchunk = triton.cdiv(triton.cdiv(d, splits), BK) * BK
            ns = triton.cdiv(d, kchunk)
            add(f"gemv BN={BN} BK={BK} warps={warps} splits={ns} acc2d={acc2d}", lambda w, BN=BN, BK=BK, warps=warps, ns=ns, kc=kchunk, a=acc2d:
                _gemv_kernel[(triton.cdiv(nout, BN), ns)](x, w, out, nout, d, kc, BN=BN, BK=BK, ACC2D=a, num_warps=warps))
        rows.sort()
        print(f"{name} ({nout} x {d}, {nbytes / 1e6:.1f} MB):", flush=True)
        gemv = [r for r in rows if r[1].startswith("gemv")]
        shown = [r for r in rows if not r[1].startswith("gemv")] + gemv[:6] + [r for r in gemv[6:] if "splits=1 " in r[1]][:4]
        for us, label in sorted(shown):
            print(f"   {us:7.2f} us  {nbytes / us / 1e6:5.2f} TB/s  {label}", flush=True)
        del ws


if __name__ == "__main__":
    main()
