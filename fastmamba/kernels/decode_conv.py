"""Mamba-1's decode conv step and its share of x_proj for one row's channels: the pieces
that in_proj's epilogue (decode_step._rmsnorm_linear_kernel with CONV) and the conv_x_proj
kernel share (decode_step.py: which of the two runs is OneRowBlocks.conv_in_in_proj)."""

from __future__ import annotations

from ._triton import jit, tl
from .activations import silu
from .gemv import add_fixed, mm


@jit
def conv_inputs(rows, rmask, n, cs_ptr, cw_ptr, cb_ptr, E, K: tl.constexpr, KP: tl.constexpr, HAS_CB: tl.constexpr, BN: tl.constexpr):
    """What the conv step of channels n needs besides x: the conv weights (BN, KP) with
    the newest tap apart (BN,), the bias (BN,) and the window's K - 1 newer inputs
    (1, BN, KP)."""
    cmask = n < E
    kk = tl.arange(0, KP)
    older = kk < K - 1
    cw = tl.load(cw_ptr + n[:, None] * K + kk[None, :], mask=cmask[:, None] & older[None, :], other=0.0)
    cw_new = tl.load(cw_ptr + n * K + K - 1, mask=cmask, other=0.0)
    if HAS_CB:
        cb = tl.load(cb_ptr + n, mask=cmask, other=0.0)
    else:
        cb = tl.zeros([BN], dtype=tl.float32)
    win = cs_ptr + rows[:, None, None] * (E * K) + n[None, :, None] * K + kk[None, None, :]
    wm = (rmask[:, None] & cmask[None, :])[:, :, None] & older[None, None, :]
    window = tl.load(win + 1, mask=wm, other=0.0).to(tl.float32)  # (the state may be 16-bit)
    return cw, cw_new, cb, window


@jit
def conv_step_tile(x, cw, cw_new, cb, window, rows, rmask, n, cs_ptr, xc_ptr, E, K: tl.constexpr, KP: tl.constexpr):
    """Channels n's conv step + SiLU on x (1, BN) -> xc (stored, and returned with zeros
    past E); the window shifts by one, x in. The rest comes from conv_inputs."""
    cmask = n < E
    m = rmask[:, None] & cmask[None, :]
    conv = tl.sum(window * cw[None, :, :], 2) + x * cw_new[None, :] + cb[None, :]
    xc = silu(conv)
    tl.store(xc_ptr + rows[:, None] * E + n[None, :], xc, mask=m)
    # The window, shifted left by one, goes back where it came from, with x last. Every
    # thread read its part before the wait; the barrier keeps a write from landing before
    # another thread's read of the same element.
    kk = tl.arange(0, KP)
    win = cs_ptr + rows[:, None, None] * (E * K) + n[None, :, None] * K + kk[None, None, :]
    tl.debug_barrier()
    tl.store(win, window.to(cs_ptr.dtype.element_ty), mask=m[:, :, None] & (kk < K - 1)[None, None, :])
    tl.store(cs_ptr + rows[:, None] * (E * K) + n[None, :] * K + K - 1, x.to(cs_ptr.dtype.element_ty), mask=m)
    return tl.where(m, xc, 0.0)


@jit
def x_proj_columns(wx_ptr, n, E, J, BJ: tl.constexpr):
    """x_proj's columns for channels n: (BJ, BN)."""
    j = tl.arange(0, BJ)
    return tl.load(wx_ptr + j[:, None] * E + n[None, :], mask=(j < J)[:, None] & (n < E)[None, :], other=0.0)


@jit
def add_x_proj_share(xc, wx, rows, rmask, dbc_ptr, wxs_ptr, J, BJ: tl.constexpr, SCALED: tl.constexpr):
    """This program's share of xc @ x_proj.T, added to dbc in fixed point (exact in any order);
    SCALED: FP8 x_proj, the share times each output row's scale (the scales distribute over
    the shares' sum)."""
    j = tl.arange(0, BJ)
    share = mm(xc, wx)
    if SCALED:
        share *= tl.load(wxs_ptr + j, mask=j < J, other=0.0)[None, :]
    add_fixed(dbc_ptr + rows[:, None] * BJ + j[None, :], share, rmask[:, None] & (j < J)[None, :])
