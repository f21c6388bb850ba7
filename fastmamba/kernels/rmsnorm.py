"""Residual add + RMSNorm in one pass, the norm written in the dtype its consumer wants.

Between two layers the residual stream h takes the mixer's output o, and the next layer
reads rmsnorm(h) * norm_w through a product with 16-bit weights; doing the add, the norm
and the rounding in one kernel reads and writes h once instead of in six element-wise
passes. Used by prefill (model.backbone through Ops.add_norm) and by the cuBLAS decode step.
"""

from __future__ import annotations

import torch

from ._triton import jit, tl, triton
from .pdl import NO_PDL, wait_for_prior_kernel
from .split16 import load_sum, store_split


def residual_rmsnorm_ref(h, o, bias, norm_w, eps):
    """(h + o + bias, rmsnorm(h + o + bias) * norm_w), float32; o None adds nothing."""
    if o is not None:
        h = h + o if bias is None else h + o + bias
    return h, h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * norm_w


@jit
def _residual_rmsnorm_kernel(
    h_ptr, o_ptr, b_ptr, nw_ptr, h_out_ptr, u_ptr, D, eps, LO,
    ADD: tl.constexpr, HAS_BIAS: tl.constexpr, O_PARTS: tl.constexpr, U_HALVES: tl.constexpr, BD: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_prior_kernel(PDL)
    row = tl.program_id(0).to(tl.int64)
    k = tl.arange(0, BD)
    km = k < D
    h = tl.load(h_ptr + row * D + k, mask=km, other=0.0)
    if ADD:
        h += load_sum(o_ptr, row * D + k, LO, km, O_PARTS)
        if HAS_BIAS:
            h += tl.load(b_ptr + k, mask=km, other=0.0)
        tl.debug_barrier()  # h_out may be h: every thread has read its elements before any write
        tl.store(h_out_ptr + row * D + k, h, mask=km)
    rstd = 1.0 / tl.sqrt(tl.sum(h * h, 0) / D + eps)
    u = h * rstd * tl.load(nw_ptr + k, mask=km, other=0.0)
    store_split(u_ptr, row * D + k, u, LO, km, U_HALVES)


def residual_rmsnorm(h, o, bias, norm_w, eps, u, h_out=None, o_parts=1, u_halves=False, pdl=NO_PDL) -> None:
    """h_out = h + o + bias (o None: nothing is added or written); u = rmsnorm(h_out) * norm_w
    in u's dtype. All (rows, d) contiguous; h_out defaults to h (in place). o_parts: o has
    that many times h's rows, a float32 result in parts to add (split16.load_sum); u_halves:
    u gets twice h's rows, a 16-bit operand in two halves (split16.py); pdl: launch options
    from pdl.pdl_launch (default: a plain launch)."""
    D = h.shape[-1]
    rows = h.numel() // D
    _residual_rmsnorm_kernel[(rows,)](
        h, o if o is not None else h, bias if bias is not None else h, norm_w, h if h_out is None else h_out, u, D, eps,
        rows * D, ADD=o is not None, HAS_BIAS=bias is not None, O_PARTS=o_parts, U_HALVES=u_halves,
        BD=triton.next_power_of_2(D),
        num_warps=8 if D > 2048 else 4, **pdl,
    )


def add_norm_ref(h, o, norm_w, eps, dtype=None):
    """Ops.add_norm of the reference path: (h + o, rmsnorm(h + o) * norm_w), float32."""
    return residual_rmsnorm_ref(h, o, None, norm_w, eps)


class _RMSNorm(torch.autograd.Function):
    """rmsnorm(h) * w in torch ops that keep only h and each row's 1 / rms for the backward
    (autograd through residual_rmsnorm_ref's ops also keeps h / rms: one (B, T, d) float32
    tensor a norm more between the passes)."""

    @staticmethod
    def forward(ctx, h, w, eps):
        rstd = torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(h, w, rstd)
        return h * rstd * w

    @staticmethod
    def backward(ctx, du):
        h, w, rstd = ctx.saved_tensors
        n = h * rstd
        dn = du * w
        dh = rstd * (dn - n * (dn * n).mean(-1, keepdim=True))
        return dh, (du * n).reshape(-1, w.shape[0]).sum(0), None


def add_norm_train(h, o, norm_w, eps, dtype=None):
    """Ops.add_norm of core/ops.training_ops: add_norm_ref's values, float32, with the norm's
    backward written out (_RMSNorm)."""
    h = h.float() if o is None else h + o
    return h, _RMSNorm.apply(h, norm_w.float(), eps)


def add_norm(h, o, norm_w, eps, dtype=torch.float32):
    """Ops.add_norm of the GPU path: a new h (h itself when o is None) and the norm in dtype."""
    h_out = h if o is None else torch.empty_like(h)
    u = torch.empty(h.shape, device=h.device, dtype=dtype)
    residual_rmsnorm(h.contiguous(), None if o is None else o.contiguous(), None, norm_w, eps, u, h_out)
    return h_out, u
