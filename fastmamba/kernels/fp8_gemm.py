"""FP8 weights' products on the GPU: a float8 e4m3 matrix (out, in) with a float32 scale a row.

Prefill (`fp8_linear`): cuBLASLt's FP8 GEMM (torch._scaled_mm, Hopper and newer), the
activations quantized a token (row) at a time to e4m3 (the row's largest magnitude / 448,
as the weights' rows are), the two row-wise scales applied to the float32 sums in the GEMM's
epilogue. Its output is bfloat16 (cuBLASLt's row-wise kernels write no float32), added to a
bias and widened in float32. Shapes cuBLASLt cannot take (a side of the weight not a
multiple of 16: an odd vocabulary's head) go through products.invariant_gemm instead, the
same arithmetic (`fp8_linear_triton`): both operands' e4m3 values widened exactly to
bfloat16, float32 sums, both scales on each sum.

The decode step's products (products.py's GEMM, the one-row kernels of decode_step.py and
decode_step_mamba2.py) read the e4m3 bytes themselves: the weight dtype is the pointer's,
and a SCALED constexpr multiplies each output's sum by its row's scale, once.

A weight reaches the kernels as two tensors (`weight_parts`): the kernels import nothing of
fastmamba outside kernels/, so an FP8 weight is anything with e4m3 `data` and a float32
`scale` a row (core/fp8.Fp8Weight); block-scaled ones are the engine's to refuse.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._triton import INTERPRET, jit, tl, triton

_E4M3_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
_FP8 = torch.float8_e4m3fn


def weight_parts(weight) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A weight as (values, its rows' float32 scales or None): a tensor as it is, an FP8
    weight (e4m3 `data` (out, in), float32 `scale` (out,)) as its two tensors."""
    if isinstance(weight, torch.Tensor):
        return weight, None
    assert getattr(weight, "block", None) is None, "block-scaled FP8 weights have no GPU kernels"
    return weight.data, weight.scale


def operand_dtype(weight) -> torch.dtype:
    """The dtype a GPU product's activations are rounded to before it reads them: bfloat16
    for an FP8 weight (its e4m3 values widen to bfloat16 exactly), the weight's own dtype
    otherwise."""
    return torch.bfloat16 if weight_parts(weight)[1] is not None else weight.dtype


def linear_ref(x: torch.Tensor, weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T + bias in float32, the decode kernels' twin: a tensor widened, an FP8
    weight's e4m3 values widened and each sum times its row's scale (as the kernels do)."""
    values, scale = weight_parts(weight)
    y = F.linear(x.float(), values.float())
    if scale is not None:
        y = y * scale
    return y if bias is None else y + bias


def quantize_rows_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, K) -> (e4m3 values (M, K), float32 scales (M, 1)): each row over its largest
    magnitude / 448 (a zero row's scale 1), rounded to nearest, saturating."""
    x = x.float()
    amax = x.abs().amax(dim=-1, keepdim=True)  # (M, 1)
    scale = torch.where(amax > 0, amax / _E4M3_MAX, torch.ones_like(amax))
    # (contiguous: element-wise ops keep a transposed view's strides, and cuBLASLt wants rows)
    return (x / scale).clamp(-_E4M3_MAX, _E4M3_MAX).to(_FP8).contiguous(), scale


@jit
def _quantize_rows_kernel(x_ptr, q_ptr, s_ptr, K, stride, BK: tl.constexpr):
    # one program a row: its largest magnitude in one pass, then the scaled values in a
    # second (the row again, from L2), with IEEE division and round-to-nearest-even as the
    # reference's torch ops, so the bits are the same
    row = tl.program_id(0).to(tl.int64)
    most = tl.zeros([BK], dtype=tl.float32)
    for k0 in range(0, K, BK):
        k = k0 + tl.arange(0, BK)
        v = tl.load(x_ptr + row * stride + k, mask=k < K, other=0.0).to(tl.float32)
        most = tl.maximum(most, tl.abs(v))
    amax = tl.max(most, axis=0)
    scale = tl.where(amax > 0, tl.math.div_rn(amax, 448.0), 1.0)
    tl.store(s_ptr + row, scale)
    for k0 in range(0, K, BK):
        k = k0 + tl.arange(0, BK)
        v = tl.load(x_ptr + row * stride + k, mask=k < K, other=0.0).to(tl.float32)
        q = tl.minimum(tl.maximum(tl.math.div_rn(v, scale), -448.0), 448.0)
        if INTERPRET:  # (the interpreter's e4m3 cast drops a rounding's carry into the exponent)
            q = _round_to_e4m3(q)
        tl.store(q_ptr + row * K + k, q.to(tl.float8e4nv), mask=k < K)


@jit
def _round_to_e4m3(v):
    # v (|v| <= 448) rounded to nearest even on e4m3's grid, exactly in float32: 3 mantissa
    # bits from 2^-6 up (the float32 pattern's low 20 bits rounded off, a carry reaching the
    # exponent), steps of 2^-9 below (e4m3's subnormals: the 1.5 * 2^23 addition rounds)
    bits = v.to(tl.int32, bitcast=True)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576).to(tl.float32, bitcast=True)
    small = ((v * 512.0 + 12582912.0) - 12582912.0) / 512.0
    return tl.where(tl.abs(v) >= 0.015625, normal, small)


def quantize_rows_triton(x: torch.Tensor, block: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_rows_ref in one kernel: the activations read twice and written once as
    e4m3, where the torch ops take seven passes (the float32 copy, abs, amax, the division,
    the clamp, the cast, the copy to rows). Bitwise the reference's."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    M, K = x.shape
    q = torch.empty(M, K, device=x.device, dtype=_FP8)
    scale = torch.empty(M, 1, device=x.device, dtype=torch.float32)
    if M:
        _quantize_rows_kernel[(M,)](x, q, scale, K, x.stride(0), BK=min(block, triton.next_power_of_2(K)))
    return q, scale


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_rows_ref's values: its Triton kernel on CUDA (no host sync: it runs inside a
    CUDA graph), the torch ops elsewhere."""
    return quantize_rows_triton(x) if x.is_cuda else quantize_rows_ref(x)


def fp8_linear_ref(x: torch.Tensor, values: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
                   out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """What fp8_linear computes, in float32: x (..., K) quantized a row, times the e4m3
    values (N, K).T, each sum scaled by its row's and its column's scale, plus bias."""
    x2 = x.reshape(-1, x.shape[-1])
    xq, sx = quantize_rows_ref(x2)
    y = (xq.float() @ values.float().t()) * sx * scale[None, :]  # (M, N)
    y = y.view(*x.shape[:-1], values.shape[0])
    return (y if bias is None else y + bias).to(out_dtype)


def scaled_mm_fits(values: torch.Tensor) -> bool:
    """Whether cuBLASLt's FP8 GEMM takes this weight: both sides multiples of 16."""
    n, k = values.shape
    return n % 16 == 0 and k % 16 == 0


def fp8_linear_triton(xq: torch.Tensor, sx: torch.Tensor, values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp8_linear's product of quantized rows (quantize_rows' xq (M, K), sx (M, 1)) through
    products.invariant_gemm, for shapes cuBLASLt's FP8 GEMM does not take: the e4m3 values of
    both widened exactly to bfloat16, float32 sums, the weight's and the row's scales on
    each sum. (M, N) float32."""
    from .products import invariant_gemm

    y = torch.empty(xq.shape[0], values.shape[0], device=xq.device, dtype=torch.float32)
    invariant_gemm(xq.to(torch.bfloat16), values, y, scale=scale)
    return y * sx


def fp8_linear(x: torch.Tensor, values: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
               out_dtype: torch.dtype = torch.float32, out: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., K) @ (values * scale).T + bias for e4m3 values (N, K) row-major and their
    float32 scales (N,): on CUDA through torch._scaled_mm with x quantized a row
    (fp8_linear_ref's arithmetic, its sums rounded once to bfloat16), or through
    products.invariant_gemm where the shape does not fit cuBLASLt; on the CPU the reference.
    Output (..., N) in out_dtype; or written into `out` (that shape, any float dtype) in one
    copy from whatever the path made, with no rounding on the way."""
    if not x.is_cuda:
        y = fp8_linear_ref(x, values, scale, bias, out_dtype if out is None else torch.float32)
        return y if out is None else out.copy_(y)
    x2 = x.reshape(-1, x.shape[-1])
    N = values.shape[0]
    xq, sx = quantize_rows(x2)
    if scaled_mm_fits(values):
        y = torch._scaled_mm(xq, values.t(), scale_a=sx, scale_b=scale.view(1, N), out_dtype=torch.bfloat16,
                             use_fast_accum=False)
    else:
        y = fp8_linear_triton(xq, sx, values, scale)
    y = y.view(*x.shape[:-1], N)
    if bias is not None:
        y = y.float() + bias
    return y.to(out_dtype) if out is None else out.copy_(y)
