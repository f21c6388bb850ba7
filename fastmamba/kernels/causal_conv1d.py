"""Causal depthwise conv1d over time with SiLU, continuing from (and updating) a conv state.

Prefill runs it over a whole prompt chunk at once. Rows of a batch may be left-padded:
positions before `start[b]` count as zero input, and a padded row (start > 0) starts from a
zero state, exactly as if the row began at `start`.

Its output is an activation (after the SiLU), like the norm's output that in_proj reads and
the scan's y that out_proj reads, so the Triton kernel writes it once, in the storage dtype
of the model: x_proj takes it as its operand and the scan reads the same values. Its input
x comes in in_proj's output dtype (model.in_proj_dtype); the sums run in float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ._triton import jit, tl, triton
from .activations import silu


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
    dtype: torch.dtype | None = None,  # the Triton kernel's output dtype; the reference keeps float32
    resets: torch.Tensor | None = None,  # (B, T) bool: the row starts afresh at t (an episode's first step)
) -> torch.Tensor:  # (B, E, T) float32, SiLU applied
    K = weight.shape[-1]
    T = x.shape[-1]
    x = x if x.dtype == torch.float64 else x.float()  # (float64: the gradient tests' oracle)
    if start is not None:
        x = x * _pad_mask(start, x.shape[-1], x.device)
        state.mul_((start == 0).view(-1, 1, 1))  # a padded row starts afresh
    # The K-1 older inputs in the state are the left context of the first new input.
    full = torch.cat([state[:, :, 1:], x], dim=-1)  # (B, E, K-1+T)
    recent = full if T == 1 else torch.cat([state, x], dim=-1)[:, :, -K:]  # the last K inputs: the new state
    if resets is None and T == 1:  # a decode step: the window's dot product (F.conv1d's CPU path costs ~30x)
        y = torch.linalg.vecdot(full, weight)[:, :, None]  # (B, E, 1)
        if bias is not None:
            y += bias[:, None]
    elif resets is None:
        y = F.conv1d(full, weight[:, None, :], bias, groups=weight.shape[0])  # (B, E, T)
    else:
        # A window at t reads the inputs of times t-K+1 .. t; those before the row's latest
        # reset at or before t are zeros (as after state.reset), and so are they in the state.
        first = segment_starts(resets, K)  # (B, T)
        times = torch.arange(T, device=x.device)[:, None] + torch.arange(1 - K, 1, device=x.device)  # (T, K)
        keep = (times[None] >= first[:, :, None])[:, None]  # (B, 1, T, K)
        y = (full.unfold(-1, K, 1) * keep * weight[None, :, None, :]).sum(-1)  # (B, E, T)
        if bias is not None:
            y = y + bias[None, :, None]
        recent = recent * (torch.arange(T - K, T, device=x.device)[None] >= first[:, -1:])[:, None, :]
    state.copy_(recent)
    return F.silu(y)


def segment_starts(resets: torch.Tensor, K: int) -> torch.Tensor:
    """(B, T) bool reset flags -> (B, T) int64: the latest reset position at or before each t,
    or -K - 1 (before anything a conv window or state holds) where the row has none yet."""
    T = resets.shape[-1]
    positions = torch.arange(T, device=resets.device).expand_as(resets)
    return torch.where(resets, positions, -K - 1).cummax(dim=-1).values


@jit
def _input_at(x_row, sxe, sxt, st_row, e, emask, p, start, K: tl.constexpr):
    """The inputs at position p (negative before the chunk) of channels e, where emask: zero
    at padding (p < start); before the chunk from the old conv state (index K + p) while
    the row has no padding (p < -start * K: p < 0 where start is 0, never where the row is
    padded, since padding starts the row from zero). p is a scalar, or positions that
    broadcast against e (the new state: a (BE, KP) tile)."""
    pp = p + tl.zeros_like(e)  # p broadcast to e's shape: masks stay tensors
    v = tl.load(x_row + p * sxt + e * sxe, mask=emask & (pp >= start) & (pp >= 0), other=0.0).to(tl.float32)
    return v + tl.load(st_row + e * K + (K + p), mask=emask & (pp >= -K) & (pp < -start * K), other=0.0).to(tl.float32)


@jit
def _tap_weight(w_ptr, e, emask, j: tl.constexpr, K: tl.constexpr):
    """The weights of the tap j steps back (0: the newest input); zero for the taps a
    kernel narrower than MAX_K lacks."""
    if j < K:
        return tl.load(w_ptr + e * K + (K - 1 - j), mask=emask, other=0.0)
    else:
        return tl.zeros_like(e).to(tl.float32)


@jit
def _causal_conv1d_kernel(
    x_ptr, sxb, sxe, sxt, w_ptr, b_ptr, st_ptr, y_ptr, start_ptr, first_ptr, T, E,
    K: tl.constexpr, KP: tl.constexpr, HAS_BIAS: tl.constexpr, BE: tl.constexpr, BT: tl.constexpr,
    STAGES: tl.constexpr, UNROLL: tl.constexpr, RESETS: tl.constexpr, HAS_START: tl.constexpr,
):
    # One program: BE channels of one row, BT time steps walked one after another with the
    # last inputs in registers (a window of MAX_K = 4: narrower kernels weigh the oldest
    # with zero), so each step loads one row of new inputs and stores one row of outputs,
    # rounded to y's dtype as a cast would.
    # It beats (time x channels) tiles with a load a tap (2.8b widths 8 x 2048: 243.7 µs
    # against 288.1).
    # Only the first time block reaches into the old conv state (the window before step 0)
    # and only it writes the new one, after its reads, so no other program can see a
    # half-updated state. RESETS: first_ptr holds, for each step, where the row's latest
    # reset at or before it fell (segment_starts); the window's inputs before it count zero.
    e = tl.program_id(0) * BE + tl.arange(0, BE)
    t0 = tl.program_id(1) * BT
    b64 = tl.program_id(2).to(tl.int64)
    emask = e < E
    if HAS_START:
        start = tl.load(start_ptr + b64)
    else:  # (no padding: no zeros to fill a start tensor, a launch fewer a decode step)
        start = tl.full([], 0, tl.int32)
    x_row = x_ptr + b64 * sxb
    st_row = st_ptr + b64 * E * K
    y_row = y_ptr + b64 * T * E
    # the weights of the inputs 3, 2, 1 and 0 steps back
    w3, w2, w1, w0 = (_tap_weight(w_ptr, e, emask, 3, K), _tap_weight(w_ptr, e, emask, 2, K),
                      _tap_weight(w_ptr, e, emask, 1, K), _tap_weight(w_ptr, e, emask, 0, K))
    if HAS_BIAS:
        bias = tl.load(b_ptr + e, mask=emask, other=0.0)
    else:
        bias = tl.zeros([BE], dtype=tl.float32)
    # the window: the inputs 3, 2 and 1 steps before the block's first step
    x3 = _input_at(x_row, sxe, sxt, st_row, e, emask, t0 - 3, start, K)
    x2 = _input_at(x_row, sxe, sxt, st_row, e, emask, t0 - 2, start, K)
    x1 = _input_at(x_row, sxe, sxt, st_row, e, emask, t0 - 1, start, K)
    # (the loads pipelined and UNROLL steps an iteration, so that several rows of x are in
    # flight a thread: see ConvTiles.stages)
    for t in tl.range(t0, tl.minimum(t0 + BT, T), num_stages=STAGES, loop_unroll_factor=UNROLL):
        x0 = tl.load(x_row + t * sxt + e * sxe, mask=emask & (t + tl.zeros_like(e) >= start), other=0.0).to(tl.float32)
        if RESETS:
            f = tl.load(first_ptr + b64 * T + t)
            acc = bias + tl.where(t - 3 >= f, w3 * x3, 0.0) + tl.where(t - 2 >= f, w2 * x2, 0.0) \
                + tl.where(t - 1 >= f, w1 * x1, 0.0) + w0 * x0
        else:
            acc = bias + w3 * x3 + w2 * x2 + w1 * x1 + w0 * x0  # oldest tap first, as F.conv1d's sum
        tl.store(y_row + t * E + e, silu(acc).to(y_ptr.dtype.element_ty), mask=emask)
        x3, x2, x1 = x2, x1, x0
    if t0 == 0:
        # New state: inputs at positions T-K .. T-1 (older ones from the old state).
        kk = tl.arange(0, KP)
        m = emask[:, None] & (kk < K)[None, :]
        new = _input_at(x_row, sxe, sxt, st_row, e[:, None], m, (T - K + kk)[None, :], start, K)
        if RESETS:  # inputs before the last segment's start are zeros in the state too
            new = tl.where((T - K + kk)[None, :] >= tl.load(first_ptr + b64 * T + T - 1), new, 0.0)
        tl.debug_barrier()  # all reads of the old state before it is rewritten
        tl.store(st_row + e[:, None] * K + kk[None, :], new.to(st_ptr.dtype.element_ty), mask=m)


@dataclass(frozen=True)
class ConvTiles:
    """causal_conv1d's launch settings (the chosen ones: engine/plan.py's CONV_TILES)."""

    be: int  # channels a program
    bt: int  # steps a program walks (the launcher takes at least MAX_K - 1)
    warps: int
    stages: int  # the walk's loads' pipeline depth (tl.range num_stages)
    unroll: int  # steps a loop iteration (tl.range loop_unroll_factor)


MAX_K = 4  # the kernel's window; wider convs (no public checkpoint has one) run the reference


def causal_conv1d(x, weight, bias, state, start=None, dtype=torch.float32, resets=None, *, tiles: ConvTiles):
    """Triton twin of `causal_conv1d_ref`; x may be any strided (B, E, T) view. Returns a
    (B, E, T) view of a (B, T, E) buffer (the layout x_proj wants) in `dtype`: computed in
    float32, rounded once on the way out. tiles: the kernel's launch settings."""
    B, E, T = x.shape
    K = weight.shape[-1]
    if K > MAX_K:
        y = causal_conv1d_ref(x, weight, bias, state, start, resets=resets)
        return y.transpose(1, 2).to(dtype).contiguous().transpose(1, 2)
    y = torch.empty(B, T, E, device=x.device, dtype=dtype)
    # (B, T) each step's latest reset (a placeholder the kernel never reads without resets)
    first = segment_starts(resets, K).to(torch.int32).contiguous() if resets is not None else y
    BT = max(tiles.bt, MAX_K - 1)  # so that only the first block's window reaches before the chunk
    _causal_conv1d_kernel[(triton.cdiv(E, tiles.be), triton.cdiv(T, BT), B)](
        x, x.stride(0), x.stride(1), x.stride(2), weight, bias if bias is not None else weight, state, y,
        start if start is not None else y, first, T, E, K=K, KP=triton.next_power_of_2(K), HAS_BIAS=bias is not None,
        BE=tiles.be, BT=BT, STAGES=tiles.stages, UNROLL=tiles.unroll, RESETS=resets is not None,
        HAS_START=start is not None, num_warps=tiles.warps,
    )
    return y.transpose(1, 2)
