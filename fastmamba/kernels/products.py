"""The matrix products, one home: through cuBLAS in the weight's own dtype
(`linear_storage`, `cublas_gemm`), and a Triton GEMM whose rows' results never depend on
how many rows there are (`invariant_gemm`: the products of the deterministic decode step).

cuBLAS picks its algorithm (tiles, split over K, reduction order) by the shape, so a row's
bits change with the batch size. Here every output element is one fixed sum: its K range is
cut into `splits` chunks whose bounds depend on K and `splits` only (not on the rows), each
chunk summed in order of K by the tensor cores (16 steps of K at a time, float32
accumulation), and the chunks land in their own slices of the output, which the consumer
adds up in a fixed order (split16.load_sum). The row and column tiles follow the number of
rows: the tensor cores treat each row alone and chain the same steps of K whatever the
tile, which the GPU tests check bitwise (on the H200, 16-bit operands gave the same bits in
mma.sync tiles of 16 rows and wgmma tiles of 64 and 128, 32-128 columns, 32-256 steps of K).
float32 weights go through three TF32 products (`tf32x3`: products within ~2^-22 of
float32's), whose three sums interleave by tile of K: there the K tile stays fixed.

With splits > 1 a short-and-wide product (x_proj, out_proj) gets enough programs to stream
its weights at batch 1, where one program a tile of columns would leave most of the GPU idle.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import torch.nn.functional as F

from ._triton import INTERPRET, jit, tl, triton
from .pdl import NO_PDL, wait_for_prior_kernel

K_ALIGN = 16  # chunk bounds fall on multiples of the tensor cores' step of K


def linear_storage(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """x @ weight.T + bias as a GPU product in the weight's own dtype (cuBLAS, float32
    accumulation), without a float32 copy of the weight; the activations are rounded to that
    dtype (a no-op when they arrive in it). The output in out_dtype: float32, or the weight's
    dtype (the float32 sum plus bias, rounded once). (model.linear is its reference.)"""
    if weight.dtype == torch.float32:
        return F.linear(x.float(), weight, bias)
    x2 = x.reshape(-1, x.shape[-1]).to(weight.dtype)
    rounded = out_dtype == weight.dtype and bias is None
    if not x.is_cuda:  # (the Triton interpreter's tests on the CPU)
        y = F.linear(x2, weight).float()
    elif rounded:
        y = torch.mm(x2, weight.t())
    else:  # straight to float32: no extra pass over the output
        y = torch.mm(x2, weight.t(), out_dtype=torch.float32)
    y = y.view(*x.shape[:-1], weight.shape[0])
    return (y if bias is None else y + bias).to(out_dtype)


def cublas_gemm(a: torch.Tensor, weight: torch.Tensor, out: torch.Tensor) -> None:
    """out = a @ weight.T in float32 through cuBLAS; a in the weight's dtype."""
    if weight.dtype == torch.float32:
        torch.mm(a, weight.t(), out=out)
    elif a.device.type == "cpu":  # (the interpreter's tests) no 16-bit mm into float32 there: upcast, exact
        torch.mm(a.float(), weight.float().t(), out=out)
    else:
        torch.mm(a, weight.t(), out_dtype=torch.float32, out=out)


def invariant_gemm_ref(a: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    """a (M, K) @ weight (N, K).T in float32; scale: e4m3 weight's row scales, on the sums."""
    y = F.linear(a.float(), weight.float())
    return y if scale is None else y * scale


@jit
def tensor_dot(a, b, acc, F32: tl.constexpr):
    """acc + a @ b on the tensor cores, float32 sums: float32 operands (F32) in three TF32
    passes (float32's accuracy), 16-bit ones as they are."""
    if F32:
        return tl.dot(a, b, acc, input_precision="tf32x3")
    elif INTERPRET:  # (the interpreter's tl.dot of 16-bit operands: see _triton)
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@jit(do_not_specialize=["M"])
def _gemm_kernel(
    a_ptr, w_ptr, s_ptr, out_ptr, M, N, K, KCHUNK,
    F32: tl.constexpr, SCALED: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr,
    PDL: tl.constexpr,
):
    # (M is not specialised on its value: the code must not change with the batch size.)
    wait_for_prior_kernel(PDL)
    pid_m = tl.program_id(0)  # row tiles first, so that the tiles sharing weights run together
    pid_n = tl.program_id(1)
    pid_s = tl.program_id(2)  # the K chunk
    rows = pid_m * BM + tl.arange(0, BM)
    n = pid_n * BN + tl.arange(0, BN)
    rmask, nmask = rows < M, n < N
    rows64 = rows.to(tl.int64)
    k_end = tl.minimum((pid_s + 1) * KCHUNK, K)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in tl.range(pid_s * KCHUNK, k_end, BK, num_stages=STAGES):
        k = k0 + tl.arange(0, BK)
        kmask = k < k_end
        a = tl.load(a_ptr + rows64[:, None] * K + k[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
        w = tl.load(w_ptr + n[:, None] * K + k[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0)
        if SCALED:  # e4m3 values, widened exactly to the operand's dtype
            w = w.to(a_ptr.dtype.element_ty)
        acc = tensor_dot(a, tl.trans(w), acc, F32)
    if SCALED:  # an FP8 weight's row scales, once on each sum
        acc *= tl.load(s_ptr + n, mask=nmask, other=0.0)[None, :]
    out = out_ptr + pid_s.to(tl.int64) * M * N + rows64[:, None] * N + n[None, :]
    tl.store(out, acc, mask=rmask[:, None] & nmask[None, :])


def split_count(K: int, splits: int) -> int:
    """How many K chunks invariant_gemm writes for `splits` asked of a K-long sum (fewer where K is
    too short for them)."""
    return triton.cdiv(K, _chunk(K, splits))


def _chunk(K: int, splits: int) -> int:
    return triton.cdiv(triton.cdiv(K, splits), K_ALIGN) * K_ALIGN


class Tiles(NamedTuple):
    BM: int  # rows
    BN: int  # columns (weight rows)
    BK: int  # steps of K a loop iteration
    stages: int  # loads in flight (tl.range num_stages)
    warps: int


def _tiles(M: int, N: int, K: int, chunks: int, f32: bool, sms: int) -> Tiles:
    """The tiles for M rows of a product in `chunks` K chunks on a GPU of `sms`
    multiprocessors. Chosen on the H200 at the public shapes (each product alone, then whole
    steps at batch 1 and 128: benchmarks/RESULTS.md); none of them changes a result, but
    float32's BK. A vocabulary-wide N is lm_head's."""
    if INTERPRET:  # numpy's matmul plus the accumulator rounds at every tile of K, unlike
        # the tensor cores' chain: there the tiles stay the same for every M
        return Tiles(16, 32, 32, 3, 4)
    vocab = N >= 16384
    if f32:  # tf32x3: BK fixed; 16-row tiles up to 32 rows, where the 64-row ones run half
        # empty (2.8b batch 32: 9.498 ms a step against 10.043), and lose from 48 rows
        t = Tiles(16 if M <= 32 else 64, 32, 32, 3, 4)
    elif M <= 16:  # one small row tile: narrow column tiles, many programs
        t = Tiles(16, 64, 128, 2, 4) if vocab else Tiles(16, 32, 128, 4, 4)
    elif M <= 64:
        t = Tiles(64, 32, 128, 3, 4)
    elif vocab:
        t = Tiles(128, 128, 64, 3, 8)
    else:
        t = Tiles(64, 128 if N >= 1024 else 64, 64, 3, 4)
    t = t._replace(BK=min(t.BK, max(16, triton.next_power_of_2(K))))
    # 64-row tiles four stages deep where the grid fits two programs an SM (four stages of
    # these tiles fit two, three fit three): where a grid needs more, a second wave costs
    # more than the depth gains (2.8b in_proj at 128 rows, 320 programs on 132 SMs). The
    # 17-64-row tiles (128 steps of K) also need a loop of four iterations to fill (130m
    # x_proj's chunks have 2): batches 9-32 1.4b ~9% faster, 130m / 370m / 2.8b 1-3%.
    if not f32 and t.BM == 64 and (M > 64 or triton.cdiv(triton.cdiv(K, chunks), t.BK) >= 4):
        if triton.cdiv(M, t.BM) * triton.cdiv(N, t.BN) * chunks <= 2 * sms:
            t = t._replace(stages=4)
    return t


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def invariant_gemm(a: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, splits: int = 1, pdl: dict = NO_PDL,
                   scale: torch.Tensor | None = None) -> None:
    """out[s * M:(s + 1) * M] = a @ weight[:, chunk s].T for each K chunk s (split_count of
    them; they add up to the whole product), float32. a (M, K) in the weight's dtype. pdl:
    launch options from pdl.pdl_launch (default: a plain launch).
    scale (N,) float32: weight holds float8 e4m3 values and each output column's sum (each
    chunk's) is multiplied by its row's scale; a in bfloat16 (or float32)."""
    M, K = a.shape
    N = weight.shape[0]
    chunk = _chunk(K, splits)
    chunks = triton.cdiv(K, chunk)
    assert out.shape == (chunks * M, N) and out.is_contiguous() and a.is_contiguous()
    assert (scale is None) == (weight.dtype != torch.float8_e4m3fn), "an FP8 weight comes with its scales"
    f32 = a.dtype == torch.float32
    # (FP8 weights: untuned, the 16-bit tiles; their bytes are half as many a tile)
    t = _tiles(M, N, K, chunks, f32, _multiprocessors(weight.device))
    grid = (triton.cdiv(M, t.BM), triton.cdiv(N, t.BN), chunks)
    _gemm_kernel[grid](a, weight, scale if scale is not None else weight, out, M, N, K, chunk, F32=f32,
                       SCALED=scale is not None, BM=t.BM, BN=t.BN, BK=t.BK, STAGES=t.stages, num_warps=t.warps, **pdl)


def linear_invariant(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                     out_dtype: torch.dtype = torch.float32, scale: torch.Tensor | None = None) -> torch.Tensor:
    """linear_storage through invariant_gemm: a row's result is the same bits at any number
    of rows (the deterministic decode of the layers that run on their ops, Mamba-2).
    scale: weight holds e4m3 values with these row scales (x rounded to bfloat16)."""
    operand = torch.bfloat16 if scale is not None else weight.dtype
    x2 = x.reshape(-1, x.shape[-1]).to(operand).contiguous()
    out = torch.empty(x2.shape[0], weight.shape[0], device=x.device, dtype=torch.float32)
    invariant_gemm(x2, weight, out, scale=scale)
    out = out.view(*x.shape[:-1], weight.shape[0])
    return (out if bias is None else out + bias).to(out_dtype)
