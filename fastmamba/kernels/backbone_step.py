"""The Backbone's step at small widths: one kernel a Mamba-1 layer, with its `_ref` twin.

At the widths of a recurrent core for RL (d_model up to 256, d_inner up to 512) every
weight of a layer fits one program's reach, so the whole layer runs in one launch: each
program takes BM batch rows and does, with h the float32 residual stream,

    u       = rmsnorm(h) * norm_w                          (the input_proj first, in layer 0)
    pass 1, BE channels at a time:
      x     = u @ in_proj[x half].T (+ bias)
      xc    = silu(conv over the window [conv state[1:], x])   conv state <- that window
      dt_r, B, C += xc @ x_proj[:, channels].T               (xc kept in a scratch row)
    pass 2, BE channels at a time:
      z     = u @ in_proj[z half].T (+ bias)
      delta = softplus(dt_r @ dt_proj[channels].T + dt_bias)
      s     = s * exp(delta A) + (delta xc) B                  ssm state read and written once
      y     = (s C + D xc) * silu(z)
      o    += y @ out_proj[:, channels].T
    h = h + o (+ bias); the last layer writes rmsnorm(h) * norm_f instead of h.

The products run on the tensor cores (tl.dot: BM rows against a BE x width weight tile,
float32 sums); their 16-bit operands are rounded once to the storage dtype, float32 weights
take three TF32 passes (products.tensor_dot). The states are read in their dtype, updated
in float32 and rounded once on store. Pass 1's xc goes through a float32 scratch (B, E)
because pass 2 walks the channels again and a register tile cannot be cut into chunks.

A row's result does not depend on the other rows, but the products' order of sums may
depend on BM (the tile): the engine keeps its deterministic mode on the decode kernels.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ._triton import jit, tl, triton
from .activations import silu, softplus
from .causal_conv1d import causal_conv1d_ref
from .pdl import NO_PDL, pdl_launch, wait_for_prior_kernel
from .products import tensor_dot
from .rmsnorm import residual_rmsnorm_ref
from .selective_scan import step_and_scan_ref


def backbone_step_ref(x, in_w, in_b, layers, norm_f, eps, conv, ssm) -> torch.Tensor:
    """One step of the Backbone's Mamba-1 layers by the kernels' reference ops (the CPU
    path's: a layer is core/mamba1.mixer over them at one token).
    x (B, I) -> (B, d) float32, rmsnorm of the last residual times norm_f; in_w, in_b: the
    input projection (None: x is the residual stream already). layers: each layer's
    weights (core/mamba1.LayerWeights' attributes). conv (L, B, E, K), ssm (L, B, E, N):
    updated in place (in float32, rounded once on store)."""
    h = F.linear(x.float(), in_w.float(), in_b) if in_w is not None else x.float()
    for i, lw in enumerate(layers):
        E, N = lw.A.shape
        R = lw.dt_proj_w.shape[1]
        u = residual_rmsnorm_ref(h, None, None, lw.norm_w, eps)[1]
        xz = F.linear(u, lw.in_proj_w.float(), lw.in_proj_b)  # (B, 2E)
        xc = causal_conv1d_ref(xz[:, :E, None], lw.conv_w, lw.conv_b, conv[i])  # (B, E, 1)
        dt_r, Bm, Cm = F.linear(xc[:, :, 0], lw.x_proj_w.float()).split([R, N, N], dim=-1)
        y = step_and_scan_ref(xc, dt_r[:, None], lw.dt_proj_w, lw.dt_bias, lw.A, Bm[:, :, None], Cm[:, :, None], lw.D,
                              xz[:, E:, None], ssm[i])  # (B, E, 1)
        h = h + F.linear(y[:, :, 0], lw.out_proj_w.float(), lw.out_proj_b)
    return residual_rmsnorm_ref(h, None, None, norm_f, eps)[1]


@jit
def _rms_scale(h, w_ptr, d, dmask, D, eps):
    """rmsnorm(h) * w over a (BM, DP) tile whose columns past D are zero."""
    w = tl.load(w_ptr + d, mask=dmask, other=0.0)
    inv = 1.0 / tl.sqrt(tl.sum(h * h, axis=1) / D + eps)
    return h * inv[:, None] * w[None, :]


@jit(do_not_specialize=["M"])
def _layer_step_kernel(
    x_ptr, win_ptr, bin_ptr, h_ptr, y_ptr,
    nw_ptr, wi_ptr, bi_ptr, cw_ptr, cb_ptr, wx_ptr, wdt_ptr, bdt_ptr, A_ptr, Dv_ptr, wo_ptr, bo_ptr, nf_ptr,
    conv_ptr, scb, sce, sck, ssm_ptr, ssb, sse, xs_ptr,
    M, I, D, E, R, eps,
    FIRST: tl.constexpr, LAST: tl.constexpr, HAS_IN: tl.constexpr, PROJ_BIAS: tl.constexpr, CONV_BIAS: tl.constexpr,
    F32: tl.constexpr, KC: tl.constexpr, KP: tl.constexpr, N: tl.constexpr, NP: tl.constexpr, RP: tl.constexpr,
    IP: tl.constexpr, DP: tl.constexpr, BM: tl.constexpr, BE: tl.constexpr, PDL: tl.constexpr,
):
    # (M is not specialised on its value: the code must not change with the batch size.)
    wait_for_prior_kernel(PDL)
    wdt = wi_ptr.dtype.element_ty  # the storage dtype: the products' operands
    sdt = ssm_ptr.dtype.element_ty
    cdt = conv_ptr.dtype.element_ty
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    rmask = rows < M
    rows64 = rows.to(tl.int64)
    d = tl.arange(0, DP)
    dmask = d < D
    hmask = rmask[:, None] & dmask[None, :]
    if FIRST and HAS_IN:  # the input projection: h = x @ input_proj.T + bias
        i = tl.arange(0, IP)
        imask = i < I
        xv = tl.load(x_ptr + rows64[:, None] * I + i[None, :], mask=rmask[:, None] & imask[None, :], other=0.0)
        w_in = tl.load(win_ptr + d[:, None] * I + i[None, :], mask=dmask[:, None] & imask[None, :], other=0.0)
        h = tensor_dot(xv.to(wdt), tl.trans(w_in), tl.zeros([BM, DP], dtype=tl.float32), F32)
        h += tl.load(bin_ptr + d, mask=dmask, other=0.0)[None, :]
    elif FIRST:
        h = tl.load(x_ptr + rows64[:, None] * D + d[None, :], mask=hmask, other=0.0)
    else:
        h = tl.load(h_ptr + rows64[:, None] * D + d[None, :], mask=hmask, other=0.0)
    u = _rms_scale(h, nw_ptr, d, dmask, D, eps).to(wdt)  # (BM, DP)

    # -- pass 1: in_proj's x half, the conv step, x_proj's sums ---------------------------
    r = tl.arange(0, RP)
    n = tl.arange(0, NP)
    k = tl.arange(0, KP)
    rmask_r, nmask = r < R, n < N
    dt_r = tl.zeros([BM, RP], dtype=tl.float32)
    Bm = tl.zeros([BM, NP], dtype=tl.float32)
    Cm = tl.zeros([BM, NP], dtype=tl.float32)
    for e0 in range(0, E, BE):
        e = e0 + tl.arange(0, BE)
        emask = e < E
        tile = rmask[:, None] & emask[None, :]
        w = tl.load(wi_ptr + e[:, None] * D + d[None, :], mask=emask[:, None] & dmask[None, :], other=0.0)
        xin = tensor_dot(u, tl.trans(w), tl.zeros([BM, BE], dtype=tl.float32), F32)  # (BM, BE)
        if PROJ_BIAS:
            xin += tl.load(bi_ptr + e, mask=emask, other=0.0)[None, :]
        # the window: the state's K-1 newest inputs, then this one; it is the new state
        sp = conv_ptr + rows64[:, None, None] * scb + e[None, :, None] * sce + k[None, None, :] * sck  # (BM, BE, KP)
        older = tl.load(sp + sck, mask=tile[:, :, None] & (k < KC - 1)[None, None, :], other=0.0).to(tl.float32)
        window = tl.where((k == KC - 1)[None, None, :], xin[:, :, None], older)
        cw = tl.load(cw_ptr + e[:, None] * KC + k[None, :], mask=emask[:, None] & (k < KC)[None, :], other=0.0)
        acc = tl.sum(window * cw[None, :, :], axis=2)  # (BM, BE)
        if CONV_BIAS:
            acc += tl.load(cb_ptr + e, mask=emask, other=0.0)[None, :]
        tl.debug_barrier()  # every thread's window read before any of it is overwritten
        tl.store(sp, window.to(cdt), mask=tile[:, :, None] & (k < KC)[None, None, :])
        xc = silu(acc)
        tl.store(xs_ptr + rows64[:, None] * E + e[None, :], xc, mask=tile)
        xc = xc.to(wdt)
        wr = tl.load(wx_ptr + r[None, :] * E + e[:, None], mask=emask[:, None] & rmask_r[None, :], other=0.0)
        dt_r = tensor_dot(xc, wr, dt_r, F32)  # (BM, RP)
        wb = tl.load(wx_ptr + (R + n[None, :]) * E + e[:, None], mask=emask[:, None] & nmask[None, :], other=0.0)
        Bm = tensor_dot(xc, wb, Bm, F32)  # (BM, NP)
        wc = tl.load(wx_ptr + (R + N + n[None, :]) * E + e[:, None], mask=emask[:, None] & nmask[None, :], other=0.0)
        Cm = tensor_dot(xc, wc, Cm, F32)
    tl.debug_barrier()  # the scratch's xc visible to every thread of the program
    dt_r = dt_r.to(wdt)

    # -- pass 2: the step sizes, the state update, the gate, out_proj ---------------------
    o = tl.zeros([BM, DP], dtype=tl.float32)
    for e0 in range(0, E, BE):
        e = e0 + tl.arange(0, BE)
        emask = e < E
        tile = rmask[:, None] & emask[None, :]
        xc = tl.load(xs_ptr + rows64[:, None] * E + e[None, :], mask=tile, other=0.0)  # (BM, BE)
        w = tl.load(wi_ptr + (E + e[:, None]) * D + d[None, :], mask=emask[:, None] & dmask[None, :], other=0.0)
        z = tensor_dot(u, tl.trans(w), tl.zeros([BM, BE], dtype=tl.float32), F32)
        if PROJ_BIAS:
            z += tl.load(bi_ptr + E + e, mask=emask, other=0.0)[None, :]
        wd = tl.load(wdt_ptr + e[None, :] * R + r[:, None], mask=rmask_r[:, None] & emask[None, :], other=0.0)
        dt = tensor_dot(dt_r, wd, tl.zeros([BM, BE], dtype=tl.float32), F32)
        delta = softplus(dt + tl.load(bdt_ptr + e, mask=emask, other=0.0)[None, :])  # (BM, BE)
        A = tl.load(A_ptr + e[:, None] * N + n[None, :], mask=emask[:, None] & nmask[None, :], other=0.0)  # (BE, NP)
        smask = tile[:, :, None] & nmask[None, None, :]
        sp = ssm_ptr + rows64[:, None, None] * ssb + e[None, :, None] * sse + n[None, None, :]  # (BM, BE, NP)
        s = tl.load(sp, mask=smask, other=0.0).to(tl.float32)
        s = s * tl.exp(delta[:, :, None] * A[None, :, :]) + (delta * xc)[:, :, None] * Bm[:, None, :]
        tl.store(sp, s.to(sdt), mask=smask)
        y = tl.sum(s * Cm[:, None, :], axis=2) + tl.load(Dv_ptr + e, mask=emask, other=0.0)[None, :] * xc
        g = (y * silu(z)).to(wdt)
        wo = tl.load(wo_ptr + d[None, :] * E + e[:, None], mask=emask[:, None] & dmask[None, :], other=0.0)  # (BE, DP)
        o = tensor_dot(g, wo, o, F32)
    h += o
    if PROJ_BIAS:
        h += tl.load(bo_ptr + d, mask=dmask, other=0.0)[None, :]
    if LAST:
        tl.store(y_ptr + rows64[:, None] * D + d[None, :], _rms_scale(h, nf_ptr, d, dmask, D, eps), mask=hmask)
    else:
        tl.store(h_ptr + rows64[:, None] * D + d[None, :], h, mask=hmask)


@dataclass(frozen=True)
class FusedStepTiles:
    """The fused step's launch settings (the engine's plan: plan.backbone_step_tiles)."""

    bm: int  # batch rows a program (16 at least: the tensor cores' tile)
    be: int  # channels a chunk of either pass (16 at least)
    warps: int
    pdl: bool  # programmatic dependent launch between the layers' kernels (Hopper and newer)


def _p2(n: int) -> int:
    return max(16, triton.next_power_of_2(n))  # (tl.dot's operands: 16 at least a side)


def backbone_step(x, in_w, in_b, layers, norm_f, eps, conv, ssm, h, xs, y, *, tiles: FusedStepTiles) -> torch.Tensor:
    """backbone_step_ref's step, one launch a layer. x (B, I) float32 contiguous; h (B, d) and
    xs (B, E) float32 scratch, y (B, d) float32 the output (returned), all preallocated so that
    the step allocates nothing (CUDA graphs). The states are updated in place."""
    M = x.shape[0]
    lw0 = layers[0]
    E, N = lw0.A.shape
    D, R, K = lw0.in_proj_w.shape[1], lw0.dt_proj_w.shape[1], lw0.conv_w.shape[1]
    I = x.shape[1]
    has_in = in_w is not None
    pdl = pdl_launch(x.device) if tiles.pdl else NO_PDL
    grid = (triton.cdiv(M, tiles.bm),)
    L = len(layers)
    for i, lw in enumerate(layers):
        cv, sv = conv[i], ssm[i]
        _layer_step_kernel[grid](
            x, in_w if has_in else x, in_b if has_in else x, h, y,
            lw.norm_w, lw.in_proj_w, lw.in_proj_b if lw.in_proj_b is not None else lw.norm_w, lw.conv_w,
            lw.conv_b if lw.conv_b is not None else lw.norm_w, lw.x_proj_w, lw.dt_proj_w, lw.dt_bias, lw.A, lw.D,
            lw.out_proj_w, lw.out_proj_b if lw.out_proj_b is not None else lw.norm_w, norm_f,
            cv, cv.stride(0), cv.stride(1), cv.stride(2), sv, sv.stride(0), sv.stride(1), xs,
            M, I, D, E, R, eps,
            FIRST=i == 0, LAST=i == L - 1, HAS_IN=has_in, PROJ_BIAS=lw.in_proj_b is not None,
            CONV_BIAS=lw.conv_b is not None, F32=lw.in_proj_w.dtype == torch.float32, KC=K,
            KP=triton.next_power_of_2(K), N=N, NP=_p2(N), RP=_p2(R), IP=_p2(I), DP=_p2(D), BM=tiles.bm, BE=tiles.be,
            num_warps=tiles.warps, **pdl,
        )
    return y
