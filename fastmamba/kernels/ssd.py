"""The Mamba-2 (SSD) scan: H heads of P channels, each head's state (P, N) decaying by one
scalar a step, its input and output through the B and C of the head's group.

`ssd_scan_ref` is the pure-PyTorch twin: the step sizes (softplus of dt + bias, clamped to
dt_limit, zero at left padding), then the chunked SSD of `ssd_ref`: quadratic inside a
chunk, a scan across chunks. `ssd_scan` runs a decode step (one token, no padding) as one
Triton kernel, `_ssd_step_kernel`, that updates every head's state in place; a longer pass
runs the twin's chunked form on the device.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._triton import jit, tl, triton
from .activations import softplus


def ssd_ref(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, Bm: torch.Tensor, Cm: torch.Tensor,
            D: torch.Tensor, state: torch.Tensor, chunk: int) -> torch.Tensor:
    """The Mamba-2 scan over T steps in chunks of `chunk`, from and into `state`.

    x (B, T, H, P), dt (B, T, H) (after softplus), A (H,), Bm and Cm (B, T, G, N), D (H,),
    state (B, H, P, N) (any float dtype: read in float32, rounded once on store).
    Returns y (B, T, H, P) float32, the D skip included. Inside a chunk, with a_t = dt_t A
    and S_t their running sum from the chunk's start,
      y_t = sum_{s<=t} exp(S_t - S_s) (C_t . B_s) dt_s x_s  +  exp(S_t) C_t . state_in
    and state_out = exp(S_last) state_in + sum_s exp(S_last - S_s) dt_s x_s (outer) B_s.
    (S_t - S_s <= 0 wherever it is used, so no exp overflows.)"""
    Bsz, T, H, P = x.shape
    G = Bm.shape[2]
    Bh = Bm.float().repeat_interleave(H // G, dim=2)  # (B, T, H, N): head h reads group h // (H / G)
    Ch = Cm.float().repeat_interleave(H // G, dim=2)
    x, dt = x.float(), dt.float()
    s = state.float()  # (B, H, P, N)
    ys = []
    for t0 in range(0, T, chunk):
        xs, dts, Bs, Cs = (v[:, t0 : t0 + chunk] for v in (x, dt, Bh, Ch))
        Q = xs.shape[1]
        S = torch.cumsum(dts * A, dim=1)  # (B, Q, H)
        diff = S[:, :, None, :] - S[:, None, :, :]  # (B, Q_t, Q_s, H): S_t - S_s
        causal = torch.ones(Q, Q, dtype=torch.bool, device=x.device).tril()[None, :, :, None]
        decay = torch.exp(diff.masked_fill(~causal, float("-inf")))  # (B, Qt, Qs, H), 0 above the diagonal
        scores = torch.einsum("bthn,bshn->btsh", Cs, Bs) * decay  # (B, Qt, Qs, H)
        y = torch.einsum("btsh,bshp->bthp", scores, xs * dts[..., None])  # within the chunk
        y = y + torch.einsum("bthn,bhpn->bthp", Cs, s) * torch.exp(S)[..., None]  # from the state coming in
        ys.append(y)
        last = S[:, -1:, :]  # (B, 1, H)
        weights = torch.exp(last - S) * dts  # (B, Q, H)
        s = s * torch.exp(last[:, 0])[:, :, None, None] + torch.einsum("bsh,bshp,bshn->bhpn", weights, xs, Bs)
    state.copy_(s)
    return torch.cat(ys, dim=1) + x * D[:, None]


def step_sizes_ref(dt: torch.Tensor, dt_bias: torch.Tensor, dt_limit: tuple[float, float], start=None) -> torch.Tensor:
    """dt (B, T, H) in_proj's raw step sizes -> clamp(softplus(dt + dt_bias), dt_limit), float32,
    zero before start (B,) (left padding: no decay, no input)."""
    dt = F.softplus(dt.float() + dt_bias).clamp(*dt_limit)
    if start is not None:
        dt = dt * (torch.arange(dt.shape[1], device=dt.device)[None, :] >= start[:, None].long())[..., None]
    return dt


def ssd_scan_ref(x, dt, dt_bias, dt_limit, A, Bm, Cm, D, state, chunk: int, start=None) -> torch.Tensor:
    """The layer's scan from in_proj's raw step sizes: x (B, T, H, P), dt (B, T, H) raw,
    Bm and Cm (B, T, G, N), state (B, H, P, N) updated in place; y (B, T, H, P) float32."""
    return ssd_ref(x, step_sizes_ref(dt, dt_bias, dt_limit, start), A, Bm, Cm, D, state, chunk)


@jit
def _ssd_step_kernel(
    x_ptr, sxb, B_ptr, C_ptr, sbb, dt_ptr, sdb, dtb_ptr, A_ptr, D_ptr, st_ptr, y_ptr, heads_per_group, dt_min, dt_max,
    H: tl.constexpr, P: tl.constexpr, N: tl.constexpr, BP: tl.constexpr, NP: tl.constexpr,
):
    # One program: one row b, one head h, BP of its P channels, all N states of each. The
    # state is read in its dtype, updated in float32 and rounded once on store.
    #   s = s exp(dt A) + dt x (outer) B_g;  y = s C_g + D x     (g = h // heads_per_group)
    b64 = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    p = tl.program_id(2) * BP + tl.arange(0, BP)
    n = tl.arange(0, NP)
    pm, nm = p < P, n < N
    g = h // heads_per_group
    dt = softplus(tl.load(dt_ptr + b64 * sdb + h).to(tl.float32) + tl.load(dtb_ptr + h))
    dt = tl.minimum(tl.maximum(dt, dt_min), dt_max)
    decay = tl.exp(dt * tl.load(A_ptr + h))
    x = tl.load(x_ptr + b64 * sxb + h * P + p, mask=pm, other=0.0).to(tl.float32)
    Bv = tl.load(B_ptr + b64 * sbb + g * N + n, mask=nm, other=0.0).to(tl.float32)
    Cv = tl.load(C_ptr + b64 * sbb + g * N + n, mask=nm, other=0.0).to(tl.float32)
    sp = st_ptr + ((b64 * H + h) * P + p[:, None]) * N + n[None, :]
    sm = pm[:, None] & nm[None, :]
    s = tl.load(sp, mask=sm, other=0.0).to(tl.float32)
    s = s * decay + (dt * x)[:, None] * Bv[None, :]
    tl.store(sp, s.to(st_ptr.dtype.element_ty), mask=sm)
    y = tl.sum(s * Cv[None, :], 1) + tl.load(D_ptr + h) * x
    tl.store(y_ptr + b64 * H * P + h * P + p, y, mask=pm)


# Channels of a head a step program takes: all N states of each in registers (2.7b's
# head of 64 x 128 in 4 programs).
SSD_STEP_BP = 16


def ssd_scan(x, dt, dt_bias, dt_limit, A, Bm, Cm, D, state, chunk: int, start=None) -> torch.Tensor:
    """Triton twin of `ssd_scan_ref` (the same arguments; x, dt, Bm, Cm may be views with
    their last dimension contiguous). A decode step runs `_ssd_step_kernel`; a pass of
    several tokens runs the twin on the device."""
    Bsz, T, H, P = x.shape
    if T > 1 or start is not None or x.stride(-1) != 1 or Bm.stride(-1) != 1 or dt.stride(-1) != 1:
        return ssd_scan_ref(x, dt, dt_bias, dt_limit, A, Bm, Cm, D, state, chunk, start)
    G, N = Bm.shape[2], Bm.shape[3]
    assert x.stride(2) == P and Bm.stride(2) == N and Cm.stride() == Bm.stride() and state.is_contiguous()
    y = torch.empty(Bsz, 1, H, P, device=x.device, dtype=torch.float32)
    BP = min(SSD_STEP_BP, triton.next_power_of_2(P))
    _ssd_step_kernel[(Bsz, H, triton.cdiv(P, BP))](
        x, x.stride(0), Bm, Cm, Bm.stride(0), dt, dt.stride(0), dt_bias, A, D, state, y, H // G,
        float(dt_limit[0]), float(dt_limit[1]), H=H, P=P, N=N, BP=BP, NP=triton.next_power_of_2(N), num_warps=4,
    )
    return y
