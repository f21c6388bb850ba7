"""Causal depthwise conv1d over time with SiLU, continuing from (and updating) a conv state.

Prefill runs it over a whole prompt chunk at once. Rows of a batch may be left-padded:
positions before `start[b]` count as zero input, and a padded row (start > 0) starts from a
zero state, exactly as if the row began at `start`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._triton import jit, tl, triton


def _pad_mask(start: torch.Tensor | None, T: int, device) -> torch.Tensor | None:
    """(B, 1, T) bool, True at real (not left-padding) positions."""
    if start is None:
        return None
    return (torch.arange(T, device=device)[None, :] >= start[:, None])[:, None, :]


def causal_conv1d_ref(
    x: torch.Tensor,  # (B, E, T) new inputs
    weight: torch.Tensor,  # (E, K)
    bias: torch.Tensor | None,  # (E,)
    state: torch.Tensor,  # (B, E, K) the last K inputs, newest last; updated in place
    start: torch.Tensor | None = None,  # (B,) first real position of each row (left padding)
    dtype: torch.dtype | None = None,  # for the second output; the reference ignores it
) -> tuple[torch.Tensor, torch.Tensor]:  # (B, E, T) float32, SiLU applied; twice (see causal_conv1d)
    K = weight.shape[-1]
    x = x.float()
    if start is not None:
        x = x * _pad_mask(start, x.shape[-1], x.device)
        state.mul_((start == 0).view(-1, 1, 1))  # a padded row starts afresh
    # The K-1 older inputs in the state are the left context of the first new input.
    full = torch.cat([state[:, :, 1:], x], dim=-1)  # (B, E, K-1+T)
    y = F.conv1d(full, weight[:, None, :], bias, groups=weight.shape[0])  # (B, E, T)
    state.copy_(torch.cat([state, x], dim=-1)[:, :, -K:])
    y = F.silu(y)
    return y, y


@jit
def _causal_conv1d_kernel(
    x_ptr, sxb, sxe, sxt, w_ptr, b_ptr, st_ptr, y_ptr, y2_ptr, start_ptr, T, E,
    K: tl.constexpr, KP: tl.constexpr, HAS_BIAS: tl.constexpr, COPY: tl.constexpr, BE: tl.constexpr, BT: tl.constexpr,
):
    # One program: one row, BE channels, BT time steps (y is (B, T, E), channels
    # contiguous). Only the first time block reads the old conv state (its taps reach back
    # before the chunk) and only it writes the new one, after its reads, so no other
    # program can see a half-updated state. (BT >= K: the taps of later blocks stay in x.)
    b = tl.program_id(0)
    e = tl.program_id(1) * BE + tl.arange(0, BE)
    first = tl.program_id(2) == 0
    emask = e < E
    start = tl.load(start_ptr + b)
    x_row = x_ptr + b.to(tl.int64) * sxb
    st_row = st_ptr + b.to(tl.int64) * E * K
    if HAS_BIAS:
        bias = tl.load(b_ptr + e, mask=emask, other=0.0)
    else:
        bias = tl.zeros([BE], dtype=tl.float32)
    t = tl.program_id(2) * BT + tl.arange(0, BT)
    acc = tl.zeros([BT, BE], dtype=tl.float32) + bias[None, :]
    if first:
        state_end = -start * K  # taps at tt < state_end read the old state
        for k in tl.static_range(K):
            tt = t - (K - 1) + k  # input position feeding tap k
            from_x = (tt >= start) & (tt >= 0) & (tt < T)
            v = tl.load(x_row + tt[:, None] * sxt + e[None, :] * sxe, mask=from_x[:, None] & emask[None, :], other=0.0)
            # positions before the chunk come from the state (index K + tt); only while the
            # row has no padding (tt >= -(K-1) > -start*K once start > 0), since padding
            # starts the row from zero
            from_state = tt < state_end
            v += tl.load(st_row + e[None, :] * K + (K + tt)[:, None], mask=from_state[:, None] & emask[None, :], other=0.0)
            acc += v * tl.load(w_ptr + e * K + k, mask=emask, other=0.0)[None, :]
    else:
        # Every other block: all taps in x (tt >= BT - K + 1 > 0), so no state loads, whose
        # addresses run along time and, added to x's (along channels), cost a layout
        # conversion through shared memory a tap: ~225 instructions a thread against ~376,
        # 2.8b 1 x 4096 91.4 -> 83.8 us, 8 x 2048 369.1 -> 330.0 (prefill_parts.py). (The
        # loop is written out twice: one loop with the state loads in a branch still
        # converts x's tiles for them, outside the branch.)
        for k in tl.static_range(K):
            tt = t - (K - 1) + k
            from_x = (tt >= start) & (tt < T)
            v = tl.load(x_row + tt[:, None] * sxt + e[None, :] * sxe, mask=from_x[:, None] & emask[None, :], other=0.0)
            acc += v * tl.load(w_ptr + e * K + k, mask=emask, other=0.0)[None, :]
    y = acc * tl.sigmoid(acc)
    out = b.to(tl.int64) * T * E + t[:, None] * E + e[None, :]
    tl.store(y_ptr + out, y, mask=(t < T)[:, None] & emask[None, :])
    if COPY:  # y in the next product's dtype, rounded as a cast would
        tl.store(y2_ptr + out, y.to(y2_ptr.dtype.element_ty), mask=(t < T)[:, None] & emask[None, :])
    if first:
        # New state: inputs at positions T-K .. T-1 (older ones from the old state).
        kk = tl.arange(0, KP)
        p = T - K + kk
        m = emask[:, None] & (kk < K)[None, :]
        new = tl.load(x_row + p[None, :] * sxt + e[:, None] * sxe, mask=m & ((p >= start) & (p >= 0))[None, :], other=0.0)
        new += tl.load(st_row + e[:, None] * K + (K + p)[None, :], mask=m & (p < -start * K)[None, :], other=0.0)
        tl.debug_barrier()  # all reads of the old state before it is rewritten
        tl.store(st_row + e[:, None] * K + kk[None, :], new, mask=m)


# Channels and time steps a program, and its warps (benchmarks/tune_conv.py, H200, 2.8b
# widths, bf16 second output): 32 x 32 with 8 warps 82 us at 1 x 4096 (~120 with 64 x 32
# and 4 warps), 347 us at 8 x 2048; small programs, many in flight, do best.
CONV_BE, CONV_BT, CONV_WARPS = 32, 32, 8


def causal_conv1d(x, weight, bias, state, start=None, dtype=torch.float32):
    """Triton twin of `causal_conv1d_ref`; x may be any strided (B, E, T) view. Returns
    (B, E, T) views of (B, T, E) buffers (the layout the projections want): the float32
    output, for the scan, and the same in `dtype`, for x_proj (written by the same kernel,
    which saves a cast's pass over the float32 one; the same tensor when dtype is float32)."""
    B, E, T = x.shape
    K = weight.shape[-1]
    y = torch.empty(B, T, E, device=x.device, dtype=torch.float32)
    y2 = y if dtype == torch.float32 else torch.empty(B, T, E, device=x.device, dtype=dtype)
    if start is None:
        start = torch.zeros(B, device=x.device, dtype=torch.int32)
    BE, BT = CONV_BE, max(CONV_BT, triton.next_power_of_2(K))
    _causal_conv1d_kernel[(B, triton.cdiv(E, BE), triton.cdiv(T, BT))](
        x, x.stride(0), x.stride(1), x.stride(2), weight, bias if bias is not None else weight, state, y, y2,
        start, T, E, K=K, KP=triton.next_power_of_2(K), HAS_BIAS=bias is not None, COPY=y2 is not y, BE=BE, BT=BT,
        num_warps=CONV_WARPS,
    )
    return y.transpose(1, 2), y2.transpose(1, 2)
