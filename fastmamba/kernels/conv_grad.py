"""The causal conv for training: an autograd Function whose forward is the prefill kernel
(causal_conv1d.py, which takes the resets) and whose backward runs in Triton, for
fastmamba.Backbone's sequence pass on CUDA (causal_conv1d_ref under autograd is the CPU path
and the oracle).

With pre_t = b + sum_k w_k x_{t-K+1+k} (inputs before the step's latest reset count zero,
the K-1 before step 0 come from the conv state) and y_t = silu(pre_t):

    dpre_t = dy_t silu'(pre_t)             (pre recomputed from the saved inputs)
    dw_k   = sum_t dpre_t x_{t-K+1+k},  db = sum_t dpre_t      (per program, then atomics)
    dx_p   = sum_k w_k dpre_{p+K-1-k}      (over the steps whose window holds p unreset)

The second sum runs over positions from -(K-1): those are the old conv state's gradient.
`deterministic=True`: each program stores its tile's dw and db sums in a slot of its own,
which torch sums in a fixed order instead of the atomics (whose order changes run to run).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._triton import jit, tl, triton
from .causal_conv1d import ConvTiles, causal_conv1d, segment_starts


@dataclass(frozen=True)
class ConvGradTiles:
    """causal_conv1d_train's launch settings (the chosen ones: engine/plan.py's CONV_GRAD_TILES)."""

    forward: ConvTiles  # the forward's: the prefill conv's kernel
    be: int  # channels of a backward program's (BT, BE) tile
    bt: int  # steps of it
    warps: int  # a backward program's


@jit
def _window_input(x_ptr, sxe, sxt, st_row, e, emask, p, tmask, first, K: tl.constexpr, RESETS: tl.constexpr):
    """The inputs at positions p (BT,) of channels e, (BT, BE): from x at p >= 0, from the
    old state (index K + p) before; zero before the step's latest reset `first` (BT,)."""
    m = tmask[:, None] & emask[None, :]
    v = tl.load(x_ptr + p[:, None] * sxt + e[None, :] * sxe, mask=m & (p >= 0)[:, None], other=0.0)
    v += tl.load(st_row + e[None, :] * K + (K + p)[:, None], mask=m & (p < 0)[:, None], other=0.0)
    if RESETS:
        v = tl.where((p >= first)[:, None], v, 0.0)
    return v


@jit
def _conv_grad_pre_kernel(
    x_ptr, sxb, sxe, sxt, st_ptr, w_ptr, b_ptr, first_ptr, dy_ptr, syb, sye, syt, dpre_ptr, dw_ptr, db_ptr, T, E,
    K: tl.constexpr, HAS_BIAS: tl.constexpr, RESETS: tl.constexpr, BE: tl.constexpr, BT: tl.constexpr,
    PARTIALS: tl.constexpr = False,
):
    # One program: BE channels and BT steps of one row. Writes dpre (B, T, E) and adds the
    # tile's sums into dw (E, K) and db (E,) (PARTIALS: stores them into its own slot of
    # (B x T / BT, E, K) and (B x T / BT, E)).
    e = tl.program_id(0) * BE + tl.arange(0, BE)
    t = tl.program_id(1) * BT + tl.arange(0, BT)
    b64 = tl.program_id(2).to(tl.int64)
    emask, tmask = e < E, t < T
    m = tmask[:, None] & emask[None, :]
    x_row, st_row = x_ptr + b64 * sxb, st_ptr + b64 * E * K
    first = t  # (unread without RESETS)
    if RESETS:
        first = tl.load(first_ptr + b64 * T + t, mask=tmask, other=0)
    if HAS_BIAS:
        pre = tl.zeros([BT, BE], dtype=tl.float32) + tl.load(b_ptr + e, mask=emask, other=0.0)[None, :]
    else:
        pre = tl.zeros([BT, BE], dtype=tl.float32)
    for k in tl.static_range(K):
        v = _window_input(x_row, sxe, sxt, st_row, e, emask, t - (K - 1) + k, tmask, first, K, RESETS)
        pre += tl.load(w_ptr + e * K + k, mask=emask, other=0.0)[None, :] * v
    sig = tl.sigmoid(pre)
    dy = tl.load(dy_ptr + b64 * syb + t[:, None] * syt + e[None, :] * sye, mask=m, other=0.0).to(tl.float32)
    dpre = tl.where(m, dy * sig * (1.0 + pre * (1.0 - sig)), 0.0)
    tl.store(dpre_ptr + (b64 * T + t[:, None]) * E + e[None, :], dpre, mask=m)
    if PARTIALS:  # this program's slot: (row, tile of steps)
        slot = b64 * tl.num_programs(1) + tl.program_id(1)
        db_ptr += slot * E
        dw_ptr += slot * E * K
    if HAS_BIAS:
        if PARTIALS:
            tl.store(db_ptr + e, tl.sum(dpre, 0), mask=emask)
        else:
            tl.atomic_add(db_ptr + e, tl.sum(dpre, 0), mask=emask)
    for k in tl.static_range(K):
        v = _window_input(x_row, sxe, sxt, st_row, e, emask, t - (K - 1) + k, tmask, first, K, RESETS)
        if PARTIALS:
            tl.store(dw_ptr + e * K + k, tl.sum(dpre * v, 0), mask=emask)
        else:
            tl.atomic_add(dw_ptr + e * K + k, tl.sum(dpre * v, 0), mask=emask)


@jit
def _conv_grad_input_kernel(
    dpre_ptr, w_ptr, first_ptr, dx_ptr, T, E,
    K: tl.constexpr, RESETS: tl.constexpr, BE: tl.constexpr, BT: tl.constexpr,
):
    # One program: BE channels of one row at BT positions p from -(K-1) on. dx (B, T+K-1, E):
    # position p at row p + K - 1 (the first K - 1 rows: the old state's gradient).
    e = tl.program_id(0) * BE + tl.arange(0, BE)
    p = tl.program_id(1) * BT + tl.arange(0, BT) - (K - 1)
    b64 = tl.program_id(2).to(tl.int64)
    emask = e < E
    acc = tl.zeros([BT, BE], dtype=tl.float32)
    for k in tl.static_range(K):
        t = p + (K - 1) - k  # the step whose window holds p at tap k
        valid = (t >= 0) & (t < T)
        if RESETS:
            valid &= p >= tl.load(first_ptr + b64 * T + t, mask=valid, other=0)
        m = valid[:, None] & emask[None, :]
        d = tl.load(dpre_ptr + (b64 * T + t[:, None]) * E + e[None, :], mask=m, other=0.0)
        acc += tl.load(w_ptr + e * K + k, mask=emask, other=0.0)[None, :] * d
    rows = p + (K - 1)
    tl.store(dx_ptr + (b64 * (T + K - 1) + rows[:, None]) * E + e[None, :], acc,
             mask=(rows < T + K - 1)[:, None] & emask[None, :])


class _Conv(torch.autograd.Function):
    """Under autocast its inputs come in float32 (the kernels' dtype; custom_fwd)."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda", cast_inputs=torch.float32)
    def forward(ctx, x, weight, bias, state, resets, tiles, deterministic=False):
        s0 = state.detach().clone()
        y = causal_conv1d(x, weight, bias, state, resets=resets, tiles=tiles.forward)  # updates the state in place
        ctx.save_for_backward(x, weight, bias, s0, resets)
        ctx.tiles, ctx.deterministic = tiles, deterministic
        ctx.mark_dirty(state)
        return y, state

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    def backward(ctx, dy, dstate):
        x, weight, bias, s0, resets = ctx.saved_tensors
        tiles = ctx.tiles
        B, E, T = x.shape
        K = weight.shape[-1]
        dev = x.device
        dpre = torch.empty(B, T, E, device=dev)
        BE, BT = tiles.be, tiles.bt
        slots = B * triton.cdiv(T, BT) if ctx.deterministic else None  # a slot a (row, tile of steps)
        dw = torch.empty(slots, E, K, device=dev) if slots else torch.zeros(E, K, device=dev)
        db = torch.empty(slots, E, device=dev) if slots else torch.zeros(E, device=dev)
        # (B, T) each step's latest reset, or a placeholder the kernels never read without resets
        first = segment_starts(resets, K).to(torch.int32).contiguous() if resets is not None else None
        first_arg = first if first is not None else dpre
        _conv_grad_pre_kernel[(triton.cdiv(E, BE), triton.cdiv(T, BT), B)](
            x, *x.stride(), s0, weight, bias if bias is not None else weight, first_arg, dy, *dy.stride(), dpre, dw, db,
            T, E, K=K, HAS_BIAS=bias is not None, RESETS=first is not None, BE=BE, BT=BT, PARTIALS=bool(slots),
            num_warps=tiles.warps,
        )
        if slots:  # the slots' sums in order
            dw, db = dw.sum(0), db.sum(0)
        dx = torch.empty(B, T + K - 1, E, device=dev)
        _conv_grad_input_kernel[(triton.cdiv(E, BE), triton.cdiv(T + K - 1, BT), B)](
            dpre, weight, first_arg, dx, T, E, K=K, RESETS=first is not None, BE=BE, BT=BT, num_warps=tiles.warps,
        )
        # the concatenation (old state, x) that the window and the new state read: (B, E, K + T)
        dfull = torch.cat([torch.zeros(B, E, 1, device=dev), dx.transpose(1, 2)], -1)
        if dstate is not None:  # the new state holds the last K inputs, zero before the last reset
            keep = torch.ones(B, K, device=dev)
            if first is not None:
                keep = (torch.arange(T - K, T, device=dev)[None] >= first[:, -1:]).float()
            dfull[..., -K:] += dstate.float() * keep[:, None, :]
        return dfull[..., K:], dw, db if bias is not None else None, dfull[..., :K].to(s0.dtype), None, None, None


def causal_conv1d_train(x, weight, bias, state, start=None, dtype=None, resets=None, *,
                        tiles: ConvGradTiles, deterministic: bool = False) -> torch.Tensor:
    """The conv with gradients (Ops.conv of core/ops.training_ops): x (B, E, T), weight (E, K),
    bias (E,) or None, state (B, E, K) updated in place (autograd follows it), resets (B, T)
    bool or None. Returns y (B, E, T) float32, as causal_conv1d_ref (whose `dtype` it
    ignores too). No left padding: a training pass has none. tiles: the kernels' launch settings.
    deterministic: no atomics (see the module's doc)."""
    if start is not None:
        raise ValueError("causal_conv1d_train takes no left padding (start)")
    return _Conv.apply(x.float(), weight.float(), None if bias is None else bias.float(), state, resets, tiles,
                       deterministic)[0]
