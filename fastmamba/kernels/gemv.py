"""The pieces of the one-row GEMV kernels that the Mamba-1 and Mamba-2 decode steps share
(decode_step.py, decode_step_mamba2.py): the float32 multiply-and-sum product of one row
and its tensor-core form, split-K programs' first tile, the residual stream's pending
share (read with h, folded into it), and the fixed-point sums in which split-K partials
meet."""

from __future__ import annotations

import torch

from ._triton import INTERPRET, jit, tl


@jit
def mm(x, w):
    """x (1, K) f32 times w (N, K).T -> (1, N) f32: a float32 multiply-and-sum, the fastest
    way to stream a matrix past one row (16-bit weights upcast exactly, float32 products)."""
    return tl.sum(w.to(tl.float32) * x, axis=1)[None, :]


@jit
def mm_terms(x, w, SUM_LAST: tl.constexpr):
    """_mm's products for one K tile, to add up over a loop of K tiles and finish with
    mm_total. With SUM_LAST: the (N, K) products themselves, unsummed (their sum across
    the tile's threads and warps, a shared-memory round trip with barriers, then runs once
    after the loop instead of once a tile); otherwise _mm's (1, N)."""
    if SUM_LAST:
        return w.to(tl.float32) * x
    else:
        return mm(x, w)


@jit
def mm_total(acc, SUM_LAST: tl.constexpr):
    """The (1, N) product from the mm_terms added up over K."""
    if SUM_LAST:
        return tl.sum(acc, axis=1)[None, :]
    else:
        return acc


# The tensor-core form of the one-row product (OneRowBlocks.in_proj_mma, out_proj_mma). For
# FP8 weights the widening of e4m3 to float32 and a multiply-and-sum per weight cost twice
# bfloat16's instructions a byte, where an f16 tensor-core product takes the widened pairs as
# they are; 16-bit weights go in as they are stored. The row is the product's second
# operand, repeated in its 16 columns (the smallest the tensor cores take), so column 0 of
# the (N, 16) result is the product; it is rounded to the operands' dtype (as transformers'
# 16-bit products round theirs). It is scaled by 2^-8 first (exact): in f16 a residual
# stream up to ~1.7e7 stays finite, and what f16 rounds away below 2^-6 (in the row's
# units) is far under e4m3's own step.
MMA_SCALE = tl.constexpr(2.0**-8)


@jit
def mma_terms(x, w, acc):
    """acc (N, 16) + the tensor cores' product of w (N, K) with the row x (1, K) in each of
    16 columns: f16 operands for e4m3 weights, else the weights' own 16-bit dtype, float32
    sums (mma_total takes the row's (1, N) out)."""
    if w.dtype.is_fp8():  # (e4m3 values are all exact in f16)
        wv = w.to(tl.float16)
    else:
        wv = w
    xb = tl.broadcast_to(tl.trans(x * MMA_SCALE), (x.shape[1], 16)).to(wv.dtype)
    if INTERPRET:  # (the interpreter's tl.dot of 16-bit operands: see _triton)
        return tl.dot(wv.to(tl.float32), xb.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(wv, xb, acc)


@jit
def mma_total(acc):
    """The (1, N) product from mma_terms' (N, 16) sums."""
    col = tl.arange(0, 16)
    return tl.sum(tl.where(col[None, :] == 0, acc, 0.0), axis=1)[None, :] * (1.0 / MMA_SCALE)


# A split-K program's product of one row with N weight rows, as mm's (1, N) float32 sums or,
# with MMA, mma_terms' (N, 16): zero sums, one K tile added, the (1, N) product.
@jit
def row_sums(N: tl.constexpr, MMA: tl.constexpr):
    if MMA:
        return tl.zeros([N, 16], dtype=tl.float32)
    else:
        return tl.zeros([1, N], dtype=tl.float32)


@jit
def add_row_tile(acc, x, w, MMA: tl.constexpr):
    """acc + x (1, K) times w (N, K).T."""
    if MMA:
        return mma_terms(x, w, acc)
    else:
        return acc + mm(x, w)


@jit
def row_total(acc, MMA: tl.constexpr):
    if MMA:
        return mma_total(acc)
    else:
        return acc


# The split-K partial sums of x_proj and out_proj meet in fixed point: int64 in units of
# 2^-32, so that the atomic adds of the splits are exact and their order cannot change
# the result. Each partial loses under 2^-32 (truncated), so a sum of S splits is within
# S * 2^-32 of the exact one: about float32's own rounding of values near 1, for S = 160
# (2.8b). Clamped to +-2^20 first (no working model comes near), a partial leaves room for
# 2^11 splits; a NaN one reads back finite, but the conv output that made it carries it
# on (D skip, state).
FIXED_SCALE = 2.0**32  # the host-side twin of FIXED_ONE, for from_fixed / to_fixed
FIXED_ONE = tl.constexpr(FIXED_SCALE)
FIXED_LIMIT = tl.constexpr(2.0**20)


@jit
def from_fixed_tile(v):
    return v.to(tl.float32) * (1.0 / FIXED_ONE)


@jit
def add_fixed(ptr, v, mask):
    """*ptr += v (float32) in fixed point, an atomic add that nothing waits for."""
    v = tl.minimum(tl.maximum(v, -FIXED_LIMIT), FIXED_LIMIT)
    tl.atomic_add(ptr, (v * FIXED_ONE).to(tl.int64), mask=mask, sem="relaxed")


def from_fixed(v: torch.Tensor) -> torch.Tensor:
    """dbc or dh as float32 (for tests and debugging)."""
    return v.float() / FIXED_SCALE


def to_fixed(v: torch.Tensor) -> torch.Tensor:
    """float32 values in dbc's and dh's fixed point (for tests)."""
    return (v.double() * FIXED_SCALE).to(torch.int64)


@jit
def prefetch_to_l2(ptrs):
    """Asks for the lines at ptrs to be fetched into L2, without waiting or holding
    registers: for weights a kernel reads only after its wait, fetched while the kernel
    before it, latency-bound, leaves the memory idle. On the GPU only (a no-op in the
    interpreter)."""
    if not INTERPRET:
        tl.inline_asm_elementwise(
            "prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32, is_pure=False, pack=1,
        )


@jit
def residual_tile(h_ptr, dh_ptr, offs, mask):
    """h + dh: the residual stream with out_proj's pending share added (float32)."""
    return tl.load(h_ptr + offs, mask=mask, other=0.0) + from_fixed_tile(tl.load(dh_ptr + offs, mask=mask, other=0))


@jit
def fold_share(h_ptr, dh_ptr, offs, mask):
    """h += dh, dh = 0 at offs (a program's columns of the residual stream, (1, BD)): a pending
    share folded in by a kernel that runs after every read of h + dh, before its next adds."""
    h_new = residual_tile(h_ptr, dh_ptr, offs, mask)
    tl.debug_barrier()  # (every thread has read its share of dh before any of it is zeroed)
    tl.store(h_ptr + offs, h_new, mask=mask)
    tl.store(dh_ptr + offs, tl.zeros(offs.shape, dtype=tl.int64), mask=mask)


@jit
def split_k_start(w_ptr, D, E, KCHUNK, BN: tl.constexpr, BK: tl.constexpr):
    """A split-K GEMV program's outputs n (of D) and their mask, the end of its K split (of
    E), and its first weight tile (BN, BK), to load before the PDL wait (program ids: row,
    output tile, split)."""
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    nmask = n < D
    k_end = tl.minimum((tl.program_id(2) + 1) * KCHUNK, E)
    k = tl.program_id(2) * KCHUNK + tl.arange(0, BK)
    w = tl.load(w_ptr + n[:, None] * E + k[None, :], mask=nmask[:, None] & (k < k_end)[None, :], other=0.0)
    return n, nmask, k_end, w
