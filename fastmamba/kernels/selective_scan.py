"""Selective scan over time (prefill): the SSM recurrence with the D skip and SiLU(z) gate.

Rows may be left-padded: before `start[b]` the step size is forced to 0 (the state passes
through unchanged) and a padded row starts from a zero state.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._triton import jit, tl, triton
from .causal_conv1d import _pad_mask


def selective_scan_ref(
    x: torch.Tensor,  # (B, E, T) conv output
    dt: torch.Tensor,  # (B, E, T) dt_proj output, before bias and softplus
    A: torch.Tensor,  # (E, N), already -exp(A_log)
    Bm: torch.Tensor,  # (B, N, T)
    Cm: torch.Tensor,  # (B, N, T)
    D: torch.Tensor,  # (E,)
    z: torch.Tensor,  # (B, E, T) gate
    dt_bias: torch.Tensor,  # (E,)
    state: torch.Tensor,  # (B, E, N) float32, updated in place to the state after the last step
    start: torch.Tensor | None = None,  # (B,) first real position of each row (left padding)
) -> torch.Tensor:  # (B, E, T) float32
    """The recurrence one time step after another, in float32: the oracle for the Triton scan."""
    x, z = x.float(), z.float()
    delta = F.softplus(dt.float() + dt_bias[None, :, None])  # (B, E, T); softplus(v) = v above 20
    s = state.clone()  # autograd may save s; the in-place write below must not change it
    if start is not None:
        real = _pad_mask(start, x.shape[-1], x.device)
        delta, x = delta * real, x * real
        s = s * (start == 0).view(-1, 1, 1)  # a padded row starts afresh
    ys = []
    for t in range(x.shape[-1]):
        decay = torch.exp(delta[:, :, t, None] * A)  # (B, E, N)
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
    z_ptr, szb, sze, szt, A_ptr, D_ptr, dtb_ptr, st_ptr, y_ptr, start_ptr, T, E,
    N: tl.constexpr, NP: tl.constexpr, BE: tl.constexpr, BT: tl.constexpr,
):
    # One program: one row, BE channels, all of time in chunks of BT steps. Inside a chunk
    # the steps are combined in parallel (associative scan of (decay, input) pairs); the
    # state is carried from chunk to chunk in registers.
    b = tl.program_id(0)
    e = tl.program_id(1) * BE + tl.arange(0, BE)
    emask = e < E
    n = tl.arange(0, NP)
    nmask = n < N
    b64 = b.to(tl.int64)
    start = tl.load(start_ptr + b)
    A = tl.load(A_ptr + e[:, None] * N + n[None, :], mask=emask[:, None] & nmask[None, :], other=0.0)  # (BE, NP)
    Dv = tl.load(D_ptr + e, mask=emask, other=0.0)
    dtb = tl.load(dtb_ptr + e, mask=emask, other=0.0)
    sp = st_ptr + b64 * E * N + e[:, None] * N + n[None, :]
    sm = emask[:, None] & nmask[None, :]
    # a padded row (start > 0) starts from zero: n >= start * NP is then never true
    s = tl.load(sp, mask=sm & (n[None, :] >= start * NP), other=0.0)  # (BE, NP)
    for t0 in range(0, T, BT):
        t = t0 + tl.arange(0, BT)
        real = (t >= start) & (t < T)
        m = real[:, None] & emask[None, :]
        x = tl.load(x_ptr + b64 * sxb + t[:, None] * sxt + e[None, :] * sxe, mask=m, other=0.0)
        dt = tl.load(dt_ptr + b64 * sdb + t[:, None] * sdt + e[None, :] * sde, mask=m, other=0.0) + dtb[None, :]
        dt = tl.where(dt > 20.0, dt, tl.log(1.0 + tl.exp(dt)))  # softplus
        dt = tl.where(m, dt, 0.0)  # padding and the tail past T leave the state alone
        bn = real[:, None] & nmask[None, :]
        Bt = tl.load(B_ptr + b64 * sbb + t[:, None] * sbt + n[None, :] * sbn, mask=bn, other=0.0)  # (BT, NP)
        Ct = tl.load(C_ptr + b64 * scb + t[:, None] * sct + n[None, :] * scn, mask=bn, other=0.0)
        decay = tl.exp(dt[:, :, None] * A[None, :, :])  # (BT, BE, NP)
        inp = (dt * x)[:, :, None] * Bt[:, None, :]
        decay_cum, inp_cum = tl.associative_scan((decay, inp), 0, _combine)
        states = decay_cum * s[None, :, :] + inp_cum  # (BT, BE, NP): the state after each step
        y = tl.sum(states * Ct[:, None, :], 2) + Dv[None, :] * x
        z = tl.load(z_ptr + b64 * szb + t[:, None] * szt + e[None, :] * sze, mask=m, other=0.0)
        y = y * z * tl.sigmoid(z)
        tl.store(y_ptr + b64 * T * E + t[:, None] * E + e[None, :], y, mask=(t < T)[:, None] & emask[None, :])
        last = tl.minimum(t0 + BT, T) - 1
        s = tl.sum(tl.where((t == last)[:, None, None], states, 0.0), 0)
    tl.debug_barrier()  # all reads of the old state before it is rewritten
    tl.store(sp, s, mask=sm)


def selective_scan(x, dt, A, Bm, Cm, D, z, dt_bias, state, start=None):
    """Triton twin of `selective_scan_ref`; inputs may be any strided views of those shapes.
    Returns a (B, E, T) view of a (B, T, E) float32 buffer."""
    Bsz, E, T = x.shape
    N = A.shape[1]
    y = torch.empty(Bsz, T, E, device=x.device, dtype=torch.float32)
    if start is None:
        start = torch.zeros(Bsz, device=x.device, dtype=torch.int32)
    BE, BT = 8, 32
    _selective_scan_kernel[(Bsz, triton.cdiv(E, BE))](
        x, *x.stride(), dt, *dt.stride(), Bm, *Bm.stride(), Cm, *Cm.stride(), z, *z.stride(),
        A, D, dt_bias, state, y, start, T, E, N=N, NP=triton.next_power_of_2(N), BE=BE, BT=BT, num_warps=4,
    )
    return y.transpose(1, 2)
