"""Parts of the batch-128 decode step (decode_gemm.py) alone, against candidate replacements,
at 2.8b widths, bf16: LAYERS launches a CUDA graph, each on its own weights and state, so
that every launch reads from memory as in a real step.

- out_proj (128 x 5120 -> 2560): cuBLAS as the step calls it, cuBLAS with the operands
  swapped (W @ y.T), and a Triton split-K GEMM writing S partial sums;
- in_proj (2 x 128 rows in two halves x 2560 -> 10240): cuBLAS, swapped;
- ssm_update: the step's kernel, and the same with each program walking ROWS rows so that
  A, dt_bias and D load once for them.

    python benchmarks/b128_parts.py
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from fastmamba.bench import time_graph_launches  # noqa: E402
from fastmamba.kernels import decode_gemm as dg  # noqa: E402
from fastmamba.kernels import products  # noqa: E402
from fastmamba.kernels.activations import softplus  # noqa: E402
from fastmamba.kernels.split16 import load_sum, store_split  # noqa: E402

LAYERS = 16
B, D, E, N, R = 128, 2560, 5120, 16, 160
BF = torch.bfloat16


@triton.jit
def _gemm_splitk(a_ptr, w_ptr, out_ptr, M, N, K, KCHUNK, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr):
    # out[s] = a[:, chunk s of K] @ w[:, chunk s].T, float32
    pid_n, pid_s, pid_m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = pid_m * BM + tl.arange(0, BM)
    n = pid_n * BN + tl.arange(0, BN)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    k_end = tl.minimum(pid_s * KCHUNK + KCHUNK, K)
    for k0 in tl.range(pid_s * KCHUNK, k_end, BK, num_stages=STAGES):
        k = k0 + tl.arange(0, BK)
        a = tl.load(a_ptr + rows[:, None] * K + k[None, :], mask=(rows < M)[:, None] & (k < k_end)[None, :], other=0.0)
        w = tl.load(w_ptr + n[:, None] * K + k[None, :], mask=(n < N)[:, None] & (k < k_end)[None, :], other=0.0)
        acc = tl.dot(a, tl.trans(w), acc)
    tl.store(out_ptr + (pid_s * M + rows[:, None]) * N + n[None, :], acc, mask=(rows < M)[:, None] & (n < N)[None, :])


@triton.jit
def _ssm_update_rows(
    dt_ptr, dbc_ptr, xc_ptr, xz_ptr, ss_ptr, dtb_ptr, A_ptr, D_ptr, y_ptr, B, E, R, J,
    N: tl.constexpr, NP: tl.constexpr, SPLIT: tl.constexpr, BE: tl.constexpr, ROWS: tl.constexpr,
):
    e = tl.program_id(0) * BE + tl.arange(0, BE)
    em = e < E
    n = tl.arange(0, NP)
    nm = n < N
    sm = em[:, None] & nm[None, :]
    A = tl.load(A_ptr + e[:, None] * N + n[None, :], mask=sm, other=0.0)
    dtb = tl.load(dtb_ptr + e, mask=em, other=0.0)
    Dv = tl.load(D_ptr + e, mask=em, other=0.0)
    for i in range(ROWS):
        row = (tl.program_id(1) * ROWS + i).to(tl.int64)
        dt = softplus(load_sum(dt_ptr, row * E + e, B * E, em, SPLIT) + dtb)
        Bv = tl.load(dbc_ptr + row * J + R + n, mask=nm, other=0.0)
        Cv = tl.load(dbc_ptr + row * J + R + N + n, mask=nm, other=0.0)
        x = tl.load(xc_ptr + row * E + e, mask=em, other=0.0)
        z = load_sum(xz_ptr, row * 2 * E + E + e, B * 2 * E, em, SPLIT)
        sp = ss_ptr + row * E * N + e[:, None] * N + n[None, :]
        s = tl.load(sp, mask=sm, other=0.0)
        s = s * tl.exp(dt[:, None] * A) + (dt * x)[:, None] * Bv[None, :]
        tl.debug_barrier()
        tl.store(sp, s, mask=sm)
        y = (tl.sum(s * Cv[None, :], 1) + Dv * x) * (z * tl.sigmoid(z))
        store_split(y_ptr, row * E + e, y, B * E, em, False)


def main() -> None:
    print(torch.cuda.get_device_name(), triton.__version__, flush=True)
    g = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape, dtype=torch.float32):
        return torch.randn(*shape, device="cuda", generator=g).to(dtype)

    # out_proj
    ws = [randn(D, E, dtype=BF) * 0.01 for _ in range(LAYERS)]
    y16 = randn(B, E, dtype=BF)
    o = torch.empty(B, D, device="cuda")
    oT = torch.empty(D, B, device="cuda")
    ref = torch.mm(y16, ws[0].t(), out_dtype=torch.float32)
    print(f"out_proj cuBLAS y @ W.T: {time_graph_launches([lambda w=w: products.cublas_gemm(y16, w, o) for w in ws]):7.2f} us", flush=True)
    print(f"out_proj cuBLAS W @ y.T: {time_graph_launches([lambda w=w: torch.mm(w, y16.t(), out_dtype=torch.float32, out=oT) for w in ws]):7.2f} us", flush=True)
    for BN, S, BK, stages, warps in ((64, 4, 64, 4, 4), (64, 2, 64, 4, 4), (128, 4, 64, 3, 8), (32, 4, 128, 3, 4), (64, 8, 64, 4, 4), (128, 8, 64, 3, 8)):
        kchunk = triton.cdiv(E, S)
        part = torch.empty(S, B, D, device="cuda")
        grid = (triton.cdiv(D, BN), S, 1)

        def run(w, BN=BN, BK=BK, stages=stages, warps=warps, kchunk=kchunk, part=part, grid=grid):
            _gemm_splitk[grid](y16, w, part, B, D, E, kchunk, BM=128, BN=BN, BK=BK, STAGES=stages, num_warps=warps)

        run(ws[0])
        err = (part.sum(0) - ref).abs().max().item()
        print(f"out_proj Triton split-K BN={BN} S={S} BK={BK} stages={stages} warps={warps}: "
              f"{time_graph_launches([lambda w=w: run(w) for w in ws]):7.2f} us (max diff {err:.1e})", flush=True)
    del ws
    # in_proj, operand in two halves
    ws = [randn(2 * E, D, dtype=BF) * 0.02 for _ in range(LAYERS)]
    u = randn(2 * B, D, dtype=BF)
    xz = torch.empty(2 * B, 2 * E, device="cuda")
    xzT = torch.empty(2 * E, 2 * B, device="cuda")
    print(f"in_proj cuBLAS u @ W.T (256 rows): {time_graph_launches([lambda w=w: products.cublas_gemm(u, w, xz) for w in ws]):7.2f} us", flush=True)
    print(f"in_proj cuBLAS W @ u.T (256 rows): {time_graph_launches([lambda w=w: torch.mm(w, u.t(), out_dtype=torch.float32, out=xzT) for w in ws]):7.2f} us", flush=True)
    print(f"in_proj cuBLAS u @ W.T (128 rows): {time_graph_launches([lambda w=w: products.cublas_gemm(u[:B], w, xz[:B]) for w in ws]):7.2f} us", flush=True)
    del ws
    # ssm_update
    states = [torch.zeros(B, E, N, device="cuda") for _ in range(LAYERS)]
    A = -torch.arange(1, N + 1, device="cuda").float().repeat(E, 1)
    dt, xz32 = randn(2 * B, E) - 4, randn(2 * B, 2 * E)
    dbc, xc = randn(B, R + 2 * N), randn(B, E)
    dtb, Dv = torch.zeros(E, device="cuda"), torch.ones(E, device="cuda")
    y = torch.empty(B, E, device="cuda", dtype=BF)
    print(f"ssm_update (step's): {time_graph_launches([lambda s=s: dg.ssm_update(dt, dbc, xc, xz32, s, dtb, A, Dv, R, y, True, False) for s in states]):7.2f} us", flush=True)
    for BE, rows, warps in ((128, 4, 4), (128, 8, 4), (64, 8, 4), (256, 4, 8), (128, 2, 4)):
        print(f"ssm_update rows={rows} BE={BE} warps={warps}: " + f"{time_graph_launches([lambda s=s, BE=BE, rows=rows, warps=warps: _ssm_update_rows[(triton.cdiv(E, BE), B // rows)](dt, dbc, xc, xz32, s, dtb, A, Dv, y, B, E, R, R + 2 * N, N=N, NP=N, SPLIT=True, BE=BE, ROWS=rows, num_warps=warps) for s in states]):7.2f} us", flush=True)


if __name__ == "__main__":
    main()
