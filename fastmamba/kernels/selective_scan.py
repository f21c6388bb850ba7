"""Selective scan over time (prefill): the SSM recurrence with the D skip and SiLU(z) gate.

Rows may be left-padded: before `start[b]` the step size is forced to 0 (the state passes
through unchanged) and a padded row starts from a zero state.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ._triton import jit, tl, triton
from .activations import silu, softplus
from .causal_conv1d import _pad_mask
from .products import linear_storage
from .step_size import StepSizeTiles, step_size, step_size_ref


def selective_scan_ref(
    x: torch.Tensor,  # (B, E, T) conv output (the Triton scan reads it in any dtype)
    delta: torch.Tensor,  # (B, E, T) step sizes, softplus(dt_proj + bias) (step_size.py)
    A: torch.Tensor,  # (E, N), already -exp(A_log)
    Bm: torch.Tensor,  # (B, N, T)
    Cm: torch.Tensor,  # (B, N, T)
    D: torch.Tensor,  # (E,)
    z: torch.Tensor,  # (B, E, T) gate
    state: torch.Tensor,  # (B, E, N) float32, updated in place to the state after the last step
    start: torch.Tensor | None = None,  # (B,) first real position of each row (left padding)
    out_dtype: torch.dtype | None = None,  # the Triton scan's y dtype; the reference keeps float32
    resets: torch.Tensor | None = None,  # (B, T) bool: the row's state is zero before step t
) -> torch.Tensor:  # (B, E, T) float32
    """The recurrence one time step after another, in float32 (float64 for float64 x, the
    gradient tests' oracle): the oracle for the Triton scan. A reset is a decay of zero at its step."""
    wide = torch.float64 if x.dtype == torch.float64 else torch.float32
    x, z, delta = x.to(wide), z.to(wide), delta.to(wide)
    s = state.clone()  # autograd may save s; the in-place write below must not change it
    if start is not None:
        real = _pad_mask(start, x.shape[-1], x.device)
        delta, x = delta * real, x * real
        s = s * (start == 0).view(-1, 1, 1)  # a padded row starts afresh
    ys = []
    for t in range(x.shape[-1]):
        decay = torch.exp(delta[:, :, t, None] * A)  # (B, E, N)
        if resets is not None:
            decay = decay * (~resets[:, t]).view(-1, 1, 1)
        s = s * decay + (delta[:, :, t] * x[:, :, t])[:, :, None] * Bm[:, None, :, t]
        ys.append(torch.einsum("ben,bn->be", s, Cm[:, :, t]))  # (B, E)
    state.copy_(s)
    y = torch.stack(ys, dim=-1) + D[None, :, None] * x  # (B, E, T)
    return y * F.silu(z)


@jit
def _combine(a_left, b_left, a_right, b_right):
    # Composing two steps s -> a*s + b: first left, then right.
    return a_left * a_right, b_left * a_right + b_right


@jit
def _selective_scan_kernel(
    x_ptr, sxb, sxe, sxt, dt_ptr, sdb, sde, sdt, B_ptr, sbb, sbn, sbt, C_ptr, scb, scn, sct,
    z_ptr, szb, sze, szt, A_ptr, D_ptr, st_ptr, y_ptr, start_ptr, resets_ptr, dtb_ptr, saved_ptr, T, E,
    N: tl.constexpr, NP: tl.constexpr, BE: tl.constexpr, BT: tl.constexpr, RESETS: tl.constexpr,
    RAW_DT: tl.constexpr = False, SAVE: tl.constexpr = False,
):
    # One program: one row, BE channels, all of time in chunks of BT steps. Inside a chunk
    # the steps are combined in parallel (associative scan of (decay, input) pairs); the
    # state is carried from chunk to chunk in registers. RESETS: a step that starts an
    # episode decays the state by zero. RAW_DT: dt holds dt_proj's output before the bias
    # dtb and the softplus, which this kernel takes. SAVE (training, scan_grad.py): the
    # state each chunk starts from goes to saved (B, chunks, E, N) for the backward.
    b = tl.program_id(0)
    e = tl.program_id(1) * BE + tl.arange(0, BE)
    emask = e < E
    n = tl.arange(0, NP)
    nmask = n < N
    b64 = b.to(tl.int64)
    start = tl.load(start_ptr + b)
    A = tl.load(A_ptr + e[:, None] * N + n[None, :], mask=emask[:, None] & nmask[None, :], other=0.0)  # (BE, NP)
    Dv = tl.load(D_ptr + e, mask=emask, other=0.0)
    sp = st_ptr + b64 * E * N + e[:, None] * N + n[None, :]
    sm = emask[:, None] & nmask[None, :]
    # a padded row (start > 0) starts from zero: n >= start * NP is then never true
    s = tl.load(sp, mask=sm & (n[None, :] >= start * NP), other=0.0).to(tl.float32)  # (BE, NP); the state may be 16-bit
    for t0 in range(0, T, BT):
        t = t0 + tl.arange(0, BT)
        real = (t >= start) & (t < T)
        m = real[:, None] & emask[None, :]
        x = tl.load(x_ptr + b64 * sxb + t[:, None] * sxt + e[None, :] * sxe, mask=m, other=0.0)
        # step sizes; zero at padding and past T, which leaves the state alone
        dt = tl.load(dt_ptr + b64 * sdb + t[:, None] * sdt + e[None, :] * sde, mask=m, other=0.0)
        if RAW_DT:
            dtb = tl.load(dtb_ptr + e, mask=emask, other=0.0)
            dt = tl.where(m, softplus(dt + dtb[None, :]), 0.0)
        if SAVE:
            chunk = (b64 * tl.cdiv(T, BT) + t0 // BT) * E * N
            tl.store(saved_ptr + chunk + e[:, None] * N + n[None, :], s, mask=sm)
        bn = real[:, None] & nmask[None, :]
        Bt = tl.load(B_ptr + b64 * sbb + t[:, None] * sbt + n[None, :] * sbn, mask=bn, other=0.0)  # (BT, NP)
        Ct = tl.load(C_ptr + b64 * scb + t[:, None] * sct + n[None, :] * scn, mask=bn, other=0.0)
        decay = tl.exp(dt[:, :, None] * A[None, :, :])  # (BT, BE, NP)
        if RESETS:
            r = tl.load(resets_ptr + b64 * T + t, mask=t < T, other=0)
            decay = tl.where((r != 0)[:, None, None], 0.0, decay)
        inp = (dt * x)[:, :, None] * Bt[:, None, :]
        decay_cum, inp_cum = tl.associative_scan((decay, inp), 0, _combine)
        states = decay_cum * s[None, :, :] + inp_cum  # (BT, BE, NP): the state after each step
        y = tl.sum(states * Ct[:, None, :], 2) + Dv[None, :] * x
        z = tl.load(z_ptr + b64 * szb + t[:, None] * szt + e[None, :] * sze, mask=m, other=0.0).to(tl.float32)
        y = y * silu(z)
        tl.store(y_ptr + b64 * T * E + t[:, None] * E + e[None, :], y, mask=(t < T)[:, None] & emask[None, :])
        last = tl.minimum(t0 + BT, T) - 1
        s = tl.sum(tl.where((t == last)[:, None, None], states, 0.0), 0)
    tl.debug_barrier()  # all reads of the old state before it is rewritten
    tl.store(sp, s.to(st_ptr.dtype.element_ty), mask=sm)


@jit
def _load(ptrs, mask, EVEN: tl.constexpr):
    """The values at ptrs; unless EVEN (every channel block full, N a power of two), 0
    outside mask. Masks cost each step's loads predicates and selects."""
    if EVEN:
        return tl.load(ptrs)
    else:
        return tl.load(ptrs, mask=mask, other=0.0)


@jit
def _store(ptrs, v, mask, EVEN: tl.constexpr):
    if EVEN:
        tl.store(ptrs, v)
    else:
        tl.store(ptrs, v, mask=mask)


@jit
def _step_decay(dt, A2, reset_row, t, RESETS: tl.constexpr):
    """Step t's decay of the state, exp(dt * A) (BE, NP), and the step's reset flag (0
    without RESETS): a step that starts an episode decays by zero."""
    decay = tl.exp2(dt[:, None] * A2)
    if RESETS:
        r = tl.load(reset_row + t).to(tl.int32)
        return tl.where(r != 0, 0.0, decay), r
    return decay, 0


@jit
def _step_input(dt_row, sde, sdt, B_row, sbn, sbt, e, emask, n, nmask, t, ze, dtb, EVEN: tl.constexpr,
                RAW_DT: tl.constexpr):
    """Step t's step size (BE,) and B (NP,). ze: _lane_zero's offset. RAW_DT: dt_row holds
    dt_proj's output before the bias dtb (the channels') and the softplus (see
    selective_scan), else the step sizes themselves. The walks start at the row's first
    real step: padding steps leave the state unchanged."""
    dt = _load(dt_row + t * sdt + ze + e * sde, emask, EVEN)
    if RAW_DT:
        dt = softplus(dt + dtb)
    Bt = _load(B_row + t * sbt + n * sbn, nmask, EVEN)
    return dt, Bt


@jit
def _channels_at(row, se, st, e, emask, t, ze, EVEN: tl.constexpr, HALF: tl.constexpr):
    """Step t's x or z (BE,), in float32. HALF: the values are 16-bit (this dtype) and row
    points to them as 32-bit words, each holding channels 2i and 2i + 1 (se, st in words).
    The walks' loads are pipelined by asynchronous copies of 4, 8 or 16 bytes a thread: a
    16-bit value at one channel a thread is too narrow for them and was a plain load waited
    for in its own step (2.8b 8 x 2048, one chunk: 1233 us against 739 with float32 x), so
    each thread loads its channel's word and keeps its half."""
    if HALF is None:
        return _load(row + t * st + ze + e * se, emask, EVEN).to(tl.float32)
    else:
        w = _load(row + t * st + ze + (e >> 1) * se, emask, EVEN)
        return tl.where((e & 1) == 1, w >> 16, w).to(tl.int16).to(HALF, bitcast=True).to(tl.float32)


@jit
def _lane_zero(zero, CPL: tl.constexpr):
    """0, as an offset that the compiler knows only to be a multiple of CPL (zero is a
    runtime 0 that the launcher does not specialise). Added to every pointer along the
    channels, it caps the loads' vectors at CPL channels, and so sets how many channels
    each thread holds: CPL (each with all N states), the lanes of a warp taking 32 * CPL
    channels side by side. Without it the loads take 4 channels a thread (16 bytes), and
    a block of fewer than 128 channels a warp splits each channel's states over lanes
    (shuffles and barriers in the loop)."""
    return zero * CPL


@jit
def _chunk_program(A2t_ptr, start_ptr, E, zero, N: tl.constexpr, NP: tl.constexpr, BE: tl.constexpr, CPL: tl.constexpr):
    """What both passes' programs start from: one row b, BE channels e, chunk c; this
    row's start; _lane_zero's offset; and log2(e) * A for the channels, loaded from its
    (N, E) transpose so that each thread holds all N states of its channels (the
    per-channel work, the gate and the sum over N for y, then happens once per channel, in
    registers). Every state they walk from is laid out (N, E) too, channels contiguous: a
    starting state in the layer's layout, (E, N), made the compiler convert each step's
    exps to it through shared memory. (Pass 2's last chunk writes the layer's new state in
    its own layout, once, after its walk.)"""
    b64 = tl.program_id(0).to(tl.int64)
    e = tl.program_id(1) * BE + tl.arange(0, BE)
    c = tl.program_id(2)
    emask = e < E
    n = tl.arange(0, NP)
    nmask = n < N
    sm = emask[:, None] & nmask[None, :]
    start = tl.load(start_ptr + b64)
    ze = _lane_zero(zero, CPL)
    A2 = tl.load(A2t_ptr + n[None, :] * E + ze + e[:, None], mask=sm, other=0.0)  # (BE, NP)
    return b64, e, c, emask, n, nmask, sm, start, ze, A2


@jit
def _dt_bias(dtb_ptr, e, emask, ze, BE: tl.constexpr, RAW_DT: tl.constexpr):
    """The channels' dt bias where the walks make their step sizes (RAW_DT), else zeros
    that nothing reads."""
    if RAW_DT:
        return tl.load(dtb_ptr + ze + e, mask=emask, other=0.0)
    else:
        return tl.zeros([BE], dtype=tl.float32)


@jit(do_not_specialize=["zero"])
def _scan_summary_kernel(
    x_ptr, sxb, sxe, sxt, dt_ptr, sdb, sde, sdt, B_ptr, sbb, sbn, sbt, A2t_ptr, start_ptr,
    sum_ptr, dts_ptr, dtb_ptr, resets_ptr, T, E, L, zero,
    N: tl.constexpr, NP: tl.constexpr, BE: tl.constexpr, CPL: tl.constexpr, EVEN: tl.constexpr,
    STAGES: tl.constexpr, UNROLL: tl.constexpr, X16: tl.constexpr, RAW_DT: tl.constexpr, RESETS: tl.constexpr,
):
    # Pass 1. One program: one row, BE channels, one chunk of L steps, walked step by step
    # from a zero state: the state the chunk leaves when it starts alone, and its summed
    # step sizes (A times that sum is the log of the chunk's whole decay). Stored (N, E)
    # (see _chunk_program). No chunk after the last needs a start, so this pass runs all
    # chunks but the last (none where the scan is one chunk). The walk skips padding,
    # whose steps change nothing. RESETS: a reset step decays by zero, and a chunk holding
    # one has no whole decay: its summed step sizes are written as -1 (real ones are >= 0).
    b64, e, c, emask, n, nmask, sm, start, ze, A2 = _chunk_program(A2t_ptr, start_ptr, E, zero, N, NP, BE, CPL)
    dtb = _dt_bias(dtb_ptr, e, emask, ze, BE, RAW_DT)
    slots = tl.num_programs(2)
    s = tl.zeros([BE, NP], dtype=tl.float32)
    dt_sum = tl.zeros([BE], dtype=tl.float32)
    reset_seen = tl.zeros([BE], dtype=tl.int32)
    x_row, dt_row, B_row = x_ptr + b64 * sxb, dt_ptr + b64 * sdb, B_ptr + b64 * sbb
    for t in tl.range(tl.maximum(c * L, start), tl.minimum(c * L + L, T), num_stages=STAGES, loop_unroll_factor=UNROLL):
        x = _channels_at(x_row, sxe, sxt, e, emask, t, ze, EVEN, X16)
        dt, Bt = _step_input(dt_row, sde, sdt, B_row, sbn, sbt, e, emask, n, nmask, t, ze, dtb, EVEN, RAW_DT)
        decay, r = _step_decay(dt, A2, resets_ptr + b64 * T, t, RESETS)
        if RESETS:
            reset_seen = tl.maximum(reset_seen, r)
        s = s * decay + (dt * x)[:, None] * Bt[None, :]
        dt_sum += dt
    if RESETS:
        dt_sum = tl.where(reset_seen != 0, -1.0, dt_sum)
    _store(sum_ptr + ((b64 * slots + c) * N + n[None, :]) * E + ze + e[:, None], s, sm, EVEN)
    _store(dts_ptr + (b64 * slots + c) * E + ze + e, dt_sum, emask, EVEN)


@jit
def _scan_prefix_kernel(
    st_ptr, start_ptr, init_ptr, sum_ptr, dts_ptr, A2t_ptr, E, slots,
    N: tl.constexpr, NP: tl.constexpr, BE: tl.constexpr, STAGES: tl.constexpr, RESETS: tl.constexpr,
):
    # Between the passes. One program: one row, BE channels. It copies the layer's old
    # state, where chunk 0 starts (zero for a padded row), to init, (N, E) for pass 2; then
    # walks the summaries in order: the state each chunk starts from is the one before it
    # decayed by that chunk's summed step sizes plus its summary. It overwrites the summary
    # of chunk c with the state chunk c + 1 starts from (its own elements, read before
    # written), so pass 2 loads one state instead of folding all the summaries before its
    # chunk (which cost it half again its steps' exps at 64 chunks).
    b64 = tl.program_id(0).to(tl.int64)
    e = tl.program_id(1) * BE + tl.arange(0, BE)
    emask = e < E
    n = tl.arange(0, NP)
    sm = emask[:, None] & (n < N)[None, :]
    A2 = tl.load(A2t_ptr + n[None, :] * E + e[:, None], mask=sm, other=0.0)  # (BE, NP)
    start = tl.load(start_ptr + b64)
    s = tl.load(st_ptr + b64 * E * N + e[:, None] * N + n[None, :], mask=sm & (n[None, :] < tl.where(start == 0, N, 0)), other=0.0).to(tl.float32)
    tl.store(init_ptr + b64 * E * N + n[None, :] * E + e[:, None], s, mask=sm)
    for c in tl.range(0, slots, num_stages=STAGES):
        dts = tl.load(dts_ptr + (b64 * slots + c) * E + e, mask=emask, other=0.0)
        ptrs = sum_ptr + ((b64 * slots + c) * N + n[None, :]) * E + e[:, None]
        decay = tl.exp2(dts[:, None] * A2)
        if RESETS:  # a chunk with a reset (-1): nothing before it survives
            decay = tl.where(dts[:, None] < 0, 0.0, decay)
        s = s * decay + tl.load(ptrs, mask=sm, other=0.0)
        tl.store(ptrs, s, mask=sm)


@jit(do_not_specialize=["zero"])
def _scan_chunks_kernel(
    x_ptr, sxb, sxe, sxt, dt_ptr, sdb, sde, sdt, B_ptr, sbb, sbn, sbt, C_ptr, scb, scn, sct,
    z_ptr, szb, sze, szt, A2t_ptr, D_ptr, st_ptr, y_ptr, start_ptr, sum_ptr, init_ptr, dtb_ptr, resets_ptr, T, E, L, zero,
    N: tl.constexpr, NP: tl.constexpr, BE: tl.constexpr, CPL: tl.constexpr, EVEN: tl.constexpr,
    STAGES: tl.constexpr, UNROLL: tl.constexpr, X16: tl.constexpr, Z16: tl.constexpr, RAW_DT: tl.constexpr,
    RESETS: tl.constexpr,
):
    # Pass 2. One program: one row, BE channels, one chunk. It starts from the state
    # _scan_prefix_kernel left in the summary slot of the chunk before it (chunk 0 from its
    # copy of the layer's old state), then walks its steps again, writing y. The last chunk
    # writes the layer's new state, which no program of this pass reads. At padding y is
    # 0 (a padded row starts from a zero state, and x is 0 there), written without a walk.
    b64, e, c, emask, n, nmask, sm, start, ze, A2 = _chunk_program(A2t_ptr, start_ptr, E, zero, N, NP, BE, CPL)
    nc = tl.num_programs(2)
    Dv = tl.load(D_ptr + ze + e, mask=emask, other=0.0)
    dtb = _dt_bias(dtb_ptr, e, emask, ze, BE, RAW_DT)
    if c == 0:
        s = tl.load(init_ptr + b64 * E * N + n[None, :] * E + ze + e[:, None], mask=sm, other=0.0)
    else:  # (then there are nc - 1 summary slots a row)
        s = tl.load(sum_ptr + ((b64 * (nc - 1) + c - 1) * N + n[None, :]) * E + ze + e[:, None], mask=sm, other=0.0)
    x_row, dt_row, B_row = x_ptr + b64 * sxb, dt_ptr + b64 * sdb, B_ptr + b64 * sbb
    C_row, z_row, y_row = C_ptr + b64 * scb, z_ptr + b64 * szb, y_ptr + b64 * T * E
    end = tl.minimum(c * L + L, T)
    for t in range(c * L, tl.minimum(start, end)):
        tl.store(y_row + t * E + ze + e, tl.zeros([BE], dtype=y_ptr.dtype.element_ty), mask=emask)
    for t in tl.range(tl.maximum(c * L, start), end, num_stages=STAGES, loop_unroll_factor=UNROLL):
        x = _channels_at(x_row, sxe, sxt, e, emask, t, ze, EVEN, X16)
        dt, Bt = _step_input(dt_row, sde, sdt, B_row, sbn, sbt, e, emask, n, nmask, t, ze, dtb, EVEN, RAW_DT)
        decay, _ = _step_decay(dt, A2, resets_ptr + b64 * T, t, RESETS)
        s = s * decay + (dt * x)[:, None] * Bt[None, :]
        Ct = _load(C_row + t * sct + n * scn, nmask, EVEN)
        z = _channels_at(z_row, sze, szt, e, emask, t, ze, EVEN, Z16)
        y = tl.sum(s * Ct[None, :], 1) + Dv * x
        _store(y_row + t * E + ze + e, y * silu(z), emask, EVEN)
    if c == nc - 1:
        tl.store(st_ptr + b64 * E * N + e[:, None] * N + n[None, :], s.to(st_ptr.dtype.element_ty), mask=sm)  # rounded once


@dataclass(frozen=True)
class ScanTiles:
    """selective_scan's and step_and_scan's launch settings and the thresholds of their
    choices (the chosen ones: engine/plan.py's SCAN_TILES). The chunked scan has two thread
    layouts: 4 channels a thread, one warp a program (fewest instructions a state: each
    step's loads of B and C serve 64 states; the GPU's schedulers then want many chunks), or
    1 channel a thread, 2-4 warps a program (4x the warps for the same channels, so fewer
    chunks fill the GPU)."""

    chunked_from: int  # the chunked scan from this many steps on,
    chunked_work: int  # or from this many channel-steps (B x E x T); below both, the one-pass scan
    chunk: int  # the chunked scan's steps a chunk; half that where full chunks give
    few_programs: int  # fewer warps than this (a program is one warp with 4 channels a thread)
    be: int  # 4 channels a thread: channels a program,
    warps: int  # its warps,
    stages: int  # its loads' pipeline depth (tl.range num_stages; the pass between's too),
    unroll: int  # and steps a loop iteration (tl.range loop_unroll_factor)
    one_chunk_lanes: int  # one chunk, one channel a thread, where B x E reaches this
    small_work: int  # one channel a thread, in chunks, below this many channel-steps (B x E x T)
    lane_stages: int  # one channel a thread: its loads' pipeline depth,
    lane_unroll: int  # and steps a loop iteration
    prefix_be: int  # the pass between the two: channels a program,
    prefix_warps: int  # and its warps
    softplus_from_rank: int  # step_and_scan: a one-chunk walk takes the softplus itself from this dt_rank up
    step_size: StepSizeTiles  # step_and_scan's step sizes otherwise (step_size.py)


LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class ScanLaunch:
    """How the chunked scan runs: chunks of L steps; BE channels a program in `warps`
    warps, CPL channels a thread (see _lane_zero); the loads' pipeline depth and steps an
    iteration."""

    L: int
    BE: int
    CPL: int
    warps: int
    stages: int
    unroll: int


def _chunked(B: int, E: int, T: int, tiles: ScanTiles) -> bool:
    """Whether selective_scan runs the chunked scan by default."""
    return T >= tiles.chunked_from or B * E * T >= tiles.chunked_work


def chunked_launch(B: int, E: int, T: int, tiles: ScanTiles) -> ScanLaunch:
    """The chunked scan's launch for B rows of E channels and T steps (see ScanTiles)."""
    if B * E >= tiles.one_chunk_lanes:
        return ScanLaunch(T, 64, 1, 2, tiles.lane_stages, tiles.lane_unroll)
    if B * E * T < tiles.small_work:
        warps = B * triton.cdiv(E, 32) * triton.cdiv(T, tiles.chunk)
        L = tiles.chunk if warps >= tiles.few_programs else tiles.chunk // 2
        return ScanLaunch(L, 128, 1, 4, tiles.lane_stages, tiles.lane_unroll)
    L = tiles.chunk
    if B * triton.cdiv(E, tiles.be) * triton.cdiv(T, L) < tiles.few_programs:
        L //= 2
    return ScanLaunch(L, tiles.be, 4, tiles.warps, tiles.stages, tiles.unroll)


_16BIT = (torch.bfloat16, torch.float16)


def _as_words(x: torch.Tensor):
    """A 16-bit x or z (B, E, T), channels contiguous, as (B, E / 2, T) 32-bit words and its
    dtype in Triton (see _channels_at); any other tensor as it is, and None."""
    pairs = x.stride(1) == 1 and x.shape[1] % 2 == 0 and x.stride(0) % 2 == 0 and x.stride(2) % 2 == 0
    if x.dtype not in _16BIT or not pairs or x.data_ptr() % 4:
        return x, None
    # tl names are read here, at launch, never at import: a CPU install has no Triton.
    as_tl = tl.bfloat16 if x.dtype == torch.bfloat16 else tl.float16
    return x.transpose(1, 2).view(torch.int32).transpose(1, 2), as_tl


def selective_scan(
    x, delta, A, Bm, Cm, D, z, state, start=None, out_dtype=torch.float32, chunked=None, launch: ScanLaunch | None = None,
    dt_bias=None, resets=None, *, tiles: ScanTiles,
):
    """Triton twin of `selective_scan_ref`; inputs may be any strided views of those shapes.
    Returns a (B, E, T) view of a (B, T, E) buffer of y in out_dtype: computed in float32,
    rounded once on the way out (as out_proj's operand, which saves a cast's passes).

    chunked: the two-pass scan (time cut into chunks that run in parallel, each walked step
    by step, with a short pass between that carries the state from chunk to chunk; one
    chunk where the rows alone fill the GPU); otherwise the one-pass scan (associative scan
    inside chunks of 32 steps, chunks one after another). By default the chunked scan from
    tiles.chunked_from steps or tiles.chunked_work channel-steps on, where its parallelism
    pays for its passes. launch: the chunked scan's, instead of chunked_launch's.

    dt_bias (E,): delta is dt_proj's output before this bias and the softplus, which the
    chunked scan's walks then add and take at each step (see step_and_scan).
    resets (B, T) bool: the row's state is zero before step t (as in selective_scan_ref).
    tiles: the launch settings and the thresholds of these choices."""
    Bsz, E, T = x.shape
    N = A.shape[1]
    y = torch.empty(Bsz, T, E, device=x.device, dtype=out_dtype)
    if start is None:
        start = torch.zeros(Bsz, device=x.device, dtype=torch.int32)
    # one byte a step, or a placeholder the kernels never read without resets
    flags = resets.to(torch.uint8).contiguous() if resets is not None else start
    if chunked is None:
        chunked = _chunked(Bsz, E, T, tiles)
    if dt_bias is not None and not chunked:
        delta, dt_bias = F.softplus(delta + dt_bias[:, None]), None
    run = (launch or chunked_launch(Bsz, E, T, tiles)) if chunked else None
    # a 16-bit x and z as words of two channels where a thread holds one (see _channels_at)
    words = chunked and run.CPL == 1
    xw, x16 = _as_words(x) if words else (x, None)
    zw, z16 = _as_words(z) if words else (z, None)
    # the kernels' first arguments, each tensor with its strides: x, delta and B (all that
    # pass 1 reads), then C and z
    xdb = (xw, *xw.stride(), delta, *delta.stride(), Bm, *Bm.stride())
    cz = (Cm, *Cm.stride(), zw, *zw.stride())
    if chunked:
        L, BE, NP = run.L, run.BE, triton.next_power_of_2(N)
        grid = (Bsz, triton.cdiv(E, BE), triton.cdiv(T, L))
        slots = max(grid[2] - 1, 1)  # pass 1's chunks: all but the last (a spare slot for one chunk)
        sums = torch.empty(Bsz, slots, N, E, device=x.device, dtype=torch.float32)
        dt_sums = torch.empty(Bsz, slots, E, device=x.device, dtype=torch.float32)
        init = torch.empty(Bsz, N, E, device=x.device, dtype=torch.float32)
        A2t = (A * LOG2E).t().contiguous()  # exp(dt * A) = exp2(dt * A2): one multiply less a state
        even = E % BE == 0 and N == NP
        walk = dict(N=N, NP=NP, BE=BE, CPL=run.CPL, EVEN=even, STAGES=run.stages, UNROLL=run.unroll, X16=x16,
                    RAW_DT=dt_bias is not None, RESETS=resets is not None, num_warps=run.warps)
        dtb = D if dt_bias is None else dt_bias  # (a placeholder the kernels never read without RAW_DT)
        if grid[2] > 1:  # one chunk starts from the layer's state alone: no summaries to make
            _scan_summary_kernel[grid[:2] + (slots,)](*xdb, A2t, start, sums, dt_sums, dtb, flags, T, E, L, 0, **walk)
        _scan_prefix_kernel[(Bsz, triton.cdiv(E, tiles.prefix_be))](
            state, start, init, sums, dt_sums, A2t, E, grid[2] - 1,
            N=N, NP=NP, BE=tiles.prefix_be, STAGES=tiles.stages, RESETS=resets is not None, num_warps=tiles.prefix_warps,
        )
        _scan_chunks_kernel[grid](*xdb, *cz, A2t, D, state, y, start, sums, init, dtb, flags, T, E, L, 0, Z16=z16, **walk)
        return y.transpose(1, 2)
    BE, BT = 8, 32
    _selective_scan_kernel[(Bsz, triton.cdiv(E, BE))](
        *xdb, *cz, A, D, state, y, start, flags, D, D, T, E, N=N, NP=triton.next_power_of_2(N), BE=BE, BT=BT,
        RESETS=resets is not None, num_warps=4,
    )
    return y.transpose(1, 2)


def step_and_scan_ref(x, dt_r, dt_w, dt_b, A, Bm, Cm, D, z, state, start=None, out_dtype=None, resets=None) -> torch.Tensor:
    """The step sizes (step_size.step_size_ref) from x_proj's dt_r (B, T, R), then the scan
    (selective_scan_ref); the other arguments as there."""
    delta = step_size_ref(dt_r, dt_w, dt_b)  # (B, T, E)
    return selective_scan_ref(x, delta.transpose(1, 2), A, Bm, Cm, D, z, state, start, resets=resets)


def step_and_scan(x, dt_r, dt_w, dt_b, A, Bm, Cm, D, z, state, start=None, out_dtype=torch.float32, resets=None, *,
                  tiles: ScanTiles) -> torch.Tensor:
    """Triton twin of `step_and_scan_ref`. Where the scan runs as one chunk (large batches)
    of a wide model (tiles.softplus_from_rank), dt_proj runs alone (cuBLAS) and the walk
    takes each step's softplus itself, once a channel and step as step_size.py's kernel
    would, without that kernel's pass over memory; otherwise that kernel writes the step
    sizes first (the chunked scan's two passes would take every softplus twice)."""
    Bsz, E, T = x.shape
    run = chunked_launch(Bsz, E, T, tiles) if _chunked(Bsz, E, T, tiles) else None
    if run is not None and run.L >= T and dt_r.shape[-1] >= tiles.softplus_from_rank:
        dt = linear_storage(dt_r, dt_w)  # (B, T, E) float32, before the bias
        return selective_scan(
            x, dt.transpose(1, 2), A, Bm, Cm, D, z, state, start, out_dtype, chunked=True, launch=run, dt_bias=dt_b,
            resets=resets, tiles=tiles,
        )
    delta = step_size(dt_r, dt_w, dt_b, tiles=tiles.step_size)
    return selective_scan(x, delta.transpose(1, 2), A, Bm, Cm, D, z, state, start, out_dtype, resets=resets, tiles=tiles)
