"""Mamba-2's gated RMSNorm: RMSNorm over each of G equal groups of a token's E channels,
gated by silu(z), before out_proj."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._triton import jit, tl, triton


def group_rmsnorm_ref(h: torch.Tensor, weight: torch.Tensor, groups: int, eps: float) -> torch.Tensor:
    """h (..., E) float32 -> RMSNorm over each of `groups` equal parts of E, times weight."""
    parts = h.unflatten(-1, (groups, -1))
    return (parts * torch.rsqrt(parts.pow(2).mean(-1, keepdim=True) + eps)).flatten(-2) * weight


def gated_rmsnorm_ref(y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, groups: int, eps: float,
                      norm_before_gate: bool = False, out_dtype=None) -> torch.Tensor:
    """RMSNorm over each of `groups` equal parts of the last dimension, gated by silu(z):
    of y * silu(z) (norm_before_gate False, every public checkpoint), else norm(y) * silu(z).
    float32 (out_dtype: the Triton kernel's; the reference keeps float32)."""
    gate = F.silu(z.float())
    h = group_rmsnorm_ref(y.float() if norm_before_gate else y.float() * gate, weight, groups, eps)
    return h * gate if norm_before_gate else h


@jit
def _gated_rmsnorm_kernel(
    y_ptr, sy, z_ptr, sz, w_ptr, out_ptr, eps, GS: tl.constexpr, BG: tl.constexpr, NORM_BEFORE_GATE: tl.constexpr,
):
    # One program: one token's group of GS channels, in float32; out rounded once.
    row = tl.program_id(0).to(tl.int64)
    e = tl.program_id(1) * GS + tl.arange(0, BG)
    m = tl.arange(0, BG) < GS
    y = tl.load(y_ptr + row * sy + e, mask=m, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + row * sz + e, mask=m, other=0.0).to(tl.float32)
    gate = z * tl.sigmoid(z)
    h = y if NORM_BEFORE_GATE else y * gate
    rstd = 1.0 / tl.sqrt(tl.sum(h * h, 0) / GS + eps)
    out = h * rstd * tl.load(w_ptr + e, mask=m, other=0.0)
    if NORM_BEFORE_GATE:
        out = out * gate
    tl.store(out_ptr + row * tl.num_programs(1) * GS + e, out.to(out_ptr.dtype.element_ty), mask=m)


def gated_rmsnorm(y, z, weight, groups: int, eps: float, norm_before_gate: bool = False, out_dtype=torch.float32):
    """Triton twin of `gated_rmsnorm_ref`: y, z (..., E) with their last dimension
    contiguous (views into in_proj's output are fine); returns (..., E) in out_dtype."""
    E = y.shape[-1]
    y2, z2 = y.reshape(-1, E), z.reshape(-1, E)
    if y2.stride(-1) != 1 or z2.stride(-1) != 1:
        y2, z2 = y2.contiguous(), z2.contiguous()
    out = torch.empty(y2.shape, device=y.device, dtype=out_dtype)
    GS = E // groups
    BG = triton.next_power_of_2(GS)
    _gated_rmsnorm_kernel[(y2.shape[0], groups)](
        y2, y2.stride(0), z2, z2.stride(0), weight, out, eps, GS=GS, BG=BG, NORM_BEFORE_GATE=norm_before_gate,
        num_warps=max(1, min(16, BG // 256)),
    )
    return out.view(y.shape)
