"""The SSM's step sizes over a prompt: delta = softplus(dt_proj(dt_r) + dt_bias).

One GEMM with the bias and softplus in its epilogue, so that delta is written once, in
float32, and both passes of the chunked scan read it: the scan then runs no log and no
exp per channel at the head of every step, and nobody writes dt before its softplus.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ._triton import INTERPRET, jit, tl, triton
from .activations import softplus


def step_size_ref(dt_r: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """dt_r (B, T, R), weight (E, R), bias (E,) -> delta (B, T, E) float32 (float64 for
    float64 dt_r: the gradient tests' oracle)."""
    wide = torch.float64 if dt_r.dtype == torch.float64 else torch.float32
    return F.softplus(F.linear(dt_r.to(wide), weight.to(wide)) + bias)


@jit
def _step_size_kernel(
    r_ptr, srm, srk, w_ptr, b_ptr, out_ptr, M, E, R,
    IEEE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):
    # One program: a BM x BN tile of delta (rows = tokens, columns = channels), over all of R.
    m = tl.program_id(0) * BM + tl.arange(0, BM)
    e = tl.program_id(1) * BN + tl.arange(0, BN)
    mm, em = m < M, e < E
    m64 = m.to(tl.int64)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, R, BK):
        k = k0 + tl.arange(0, BK)
        km = k < R
        a = tl.load(r_ptr + m64[:, None] * srm + k[None, :] * srk, mask=mm[:, None] & km[None, :], other=0.0)
        w = tl.load(w_ptr + e[None, :] * R + k[:, None], mask=em[None, :] & km[:, None], other=0.0)  # (BK, BN)
        if IEEE:  # float32 weights: exact float32 products
            acc = tl.dot(a, w, acc, input_precision="ieee")
        elif INTERPRET:  # (the interpreter's tl.dot of 16-bit operands: see _triton)
            acc = tl.dot(a.to(w.dtype).to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
        else:  # the activations rounded to the weights' dtype, as cuBLAS products take them
            acc = tl.dot(a.to(w.dtype), w, acc)
    v = acc + tl.load(b_ptr + e, mask=em, other=0.0)[None, :]
    tl.store(out_ptr + m64[:, None] * E + e[None, :], softplus(v), mask=mm[:, None] & em[None, :])


@dataclass(frozen=True)
class StepSizeTiles:
    """step_size's launch settings (the chosen ones: engine/plan.py's STEP_SIZE_TILES)."""

    bm: int  # tokens of a program's tile
    bn: int  # channels of it
    bk: int  # dt_rank a step of the loop over it
    warps: int
    stages: int  # the loop's pipeline depth (num_stages)


def step_size(dt_r: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, *, tiles: StepSizeTiles) -> torch.Tensor:
    """Triton twin of `step_size_ref`; dt_r (B, T, R) float32, any strides (a slice of
    x_proj's output). Returns a contiguous (B, T, E) float32 tensor. tiles: the kernel's
    launch settings."""
    Bsz, T, R = dt_r.shape
    E = weight.shape[0]
    r2 = dt_r.reshape(Bsz * T, R)  # a view where the strides allow (x_proj's slice), else a copy
    out = torch.empty(Bsz, T, E, device=dt_r.device, dtype=torch.float32)
    M = Bsz * T
    _step_size_kernel[(triton.cdiv(M, tiles.bm), triton.cdiv(E, tiles.bn))](
        r2, *r2.stride(), weight, bias, out, M, E, R, IEEE=weight.dtype == torch.float32,
        BM=tiles.bm, BN=tiles.bn, BK=tiles.bk, num_warps=tiles.warps, num_stages=tiles.stages,
    )
    return out
