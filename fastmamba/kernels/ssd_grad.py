"""The Mamba-2 (SSD) scan under autograd, for training on stored sequences with resets
(fastmamba.Backbone's Mamba-2 layer).

- `ssd_sequential_ref`: the recurrence one step after another, functional (the oracle);
- `ssd_chunked`: the same sums in chunks (quadratic inside a chunk, the state passed from
  chunk to chunk), functional, written in torch ops that autograd differentiates: the
  training path on the CPU and on CUDA;
- `ssd_scan_train`: `ssd.ssd_scan_ref`'s signature over `ssd_chunked` (in_proj's raw step
  sizes in, the state updated in place), for core/ops.Ops.

Both keep float64 inputs in float64 (the gradient tests' oracle), else compute in float32.
A reset at (b, t) means row b's state is zero before step t, as everywhere in fastmamba
(ssd.ssd_ref): a decay of zero at that step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ._triton import jit, tl, triton
from .causal_conv1d import segment_starts
from .products import tensor_dot
from .ssd import (
    SSDTiles,
    _ssd_chunk_scan_kernel,
    _ssd_chunk_state_kernel,
    _ssd_state_passing_kernel,
    _ssd_step_sizes_kernel,
)


def _wide(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _heads(m: torch.Tensor, H: int, dtype) -> torch.Tensor:
    """(B, T, G, N) -> (B, T, H, N): head h reads group h // (H / G)."""
    return m.to(dtype).repeat_interleave(H // m.shape[2], dim=2)


def ssd_sequential_ref(x, dt, A, Bm, Cm, D, state, resets=None):
    """y, new_state: the Mamba-2 recurrence step by step. x (B, T, H, P), dt (B, T, H) (after
    softplus), A (H,), Bm and Cm (B, T, G, N), D (H,), state (B, H, P, N) (not modified);
    resets (B, T) bool. Per step, with r_t = 0 at a reset else 1:
      s = r_t exp(dt_t A) s + dt_t x_t (outer) B_t;   y_t = s C_t + D x_t."""
    wide = _wide(x)
    H = x.shape[2]
    x, dt, A, D = x.to(wide), dt.to(wide), A.to(wide), D.to(wide)
    Bh, Ch = _heads(Bm, H, wide), _heads(Cm, H, wide)
    s = state.to(wide)
    ys = []
    for t in range(x.shape[1]):
        decay = torch.exp(dt[:, t] * A)  # (B, H)
        if resets is not None:
            decay = decay * (~resets[:, t, None]).to(wide)
        s = s * decay[..., None, None] + (dt[:, t, :, None] * x[:, t])[..., None] * Bh[:, t, :, None, :]
        ys.append(torch.einsum("bhpn,bhn->bhp", s, Ch[:, t]))
    return torch.stack(ys, 1) + x * D[:, None], s


def ssd_chunked(x, dt, A, Bm, Cm, D, state, chunk: int, resets=None):
    """y, new_state: `ssd_sequential_ref`'s sums in chunks of `chunk` steps (the arguments as
    there; state not modified). Inside a chunk, with S_t the running sum of dt A from the
    chunk's start,
      y_t = sum_{s<=t} exp(S_t - S_s) (C_t . B_s) dt_s x_s + exp(S_t) C_t . s_in + D x_t,
      s_out = exp(S_last) s_in + sum_s exp(S_last - S_s) dt_s x_s (outer) B_s;
    a term from step s (or from s_in) reaches t only if no reset lies in (s, t] (each step's
    latest reset, segment_starts, is the same for both). No tensor is written in place, so
    autograd differentiates every input, the state included."""
    wide = _wide(x)
    T, H = x.shape[1:3]
    # heads first: (B, H, T, .) so that every product below is a batched matmul
    x, dt = x.to(wide).transpose(1, 2), dt.to(wide).transpose(1, 2)  # (B, H, T, P), (B, H, T)
    A, D = A.to(wide)[:, None], D.to(wide)
    Bh, Ch = _heads(Bm, H, wide).transpose(1, 2), _heads(Cm, H, wide).transpose(1, 2)  # (B, H, T, N)
    first = None if resets is None else segment_starts(resets, 0)[:, None]  # (B, 1, T): the latest reset, -1 before any
    s = state.to(wide)  # (B, H, P, N)
    ys = []
    for t0 in range(0, T, chunk):
        xs, dts, Bs, Cs = (v[:, :, t0 : t0 + chunk] for v in (x, dt, Bh, Ch))
        Q = xs.shape[2]
        S = torch.cumsum(dts * A, dim=-1)  # (B, H, Q)
        reach = torch.ones(Q, Q, dtype=torch.bool, device=x.device).tril()  # (Qt, Qs): s <= t
        from_in = torch.exp(S)  # (B, H, Q): s_in's decay to each step
        to_end = torch.exp(S[..., -1:] - S) * dts  # (B, H, Q): each step's input's weight in s_out
        if first is not None:
            f = first[..., t0 : t0 + chunk]  # (B, 1, Q)
            reach = reach & (f[..., :, None] == f[..., None, :])  # (B, 1, Qt, Qs)
            from_in = from_in * (f < t0)
            to_end = to_end * (f == f[..., -1:])
        # exp only where s reaches t (S_t - S_s <= 0 there: no overflow, and no inf * 0 in
        # the backward of the masked entries)
        decay = torch.exp((S[..., :, None] - S[..., None, :]).masked_fill(~reach, float("-inf")))  # (B, H, Qt, Qs)
        scores = (Cs @ Bs.transpose(-1, -2)) * decay  # (B, H, Qt, Qs)
        y = scores @ (xs * dts[..., None]) + (Cs @ s.transpose(-1, -2)) * from_in[..., None]  # (B, H, Q, P)
        ys.append(y)
        s = s * from_in[..., -1, None, None] + (xs * to_end[..., None]).transpose(-1, -2) @ Bs
    return (torch.cat(ys, dim=2) + x * D[:, None, None]).transpose(1, 2), s


def step_sizes(dt, dt_bias, dt_limit) -> torch.Tensor:
    """clamp(softplus(dt + dt_bias), dt_limit), in float64 for float64 dt, else float32."""
    wide = _wide(dt)
    return F.softplus(dt.to(wide) + dt_bias.to(wide)).clamp(*dt_limit)


def ssd_scan_train(x, dt, dt_bias, dt_limit, A, Bm, Cm, D, state, chunk: int, start=None, resets=None) -> torch.Tensor:
    """`ssd.ssd_scan_ref`'s signature (in_proj's raw step sizes; state (B, H, P, N) updated in
    place, y (B, T, H, P) returned) over `ssd_chunked`, which autograd differentiates: the
    state is read through a copy, so that the write below leaves autograd's saved tensors
    alone. start: left padding, as there."""
    steps = step_sizes(dt, dt_bias, dt_limit)
    if start is not None:
        steps = steps * (torch.arange(steps.shape[1], device=steps.device)[None, :] >= start[:, None])[..., None]
    y, new = ssd_chunked(x, steps, A, Bm, Cm, D, state.clone(), chunk, resets)
    state.copy_(new)
    return y


# -- the Triton training SSD: the language model's chunked forward kernels, and a backward ----
#
# Forward: kernels/ssd.py's step sizes, chunk states, state passing and chunk scan (as
# ssd.ssd_scan's long path, in chunks of SSDGradTiles.chunk steps), keeping the step sizes,
# their running sums and the state each chunk starts from for the backward.
# Backward, with g_c the gradient of the state after chunk c (g_last: the new state's):
# 1. each chunk's gradient of the state it starts from through its outputs,
#    Y_c = sum_t exp(S_t) dy_t (outer) C_t (`_ssd_bwd_dstart_kernel`);
# 2. g_{c-1} = decay_c g_c + Y_c from the last chunk back (torch, a few ops a chunk), the
#    initial state's gradient the last of them;
# 3. each chunk's gradients of x, B, C, dt and its parts of A's and D's, from its inputs,
#    the state it started from and g_c, the chunk's (Q, Q) products recomputed in registers
#    (`_ssd_bwd_chunk_kernel`);
# 4. the heads' B and C summed by group, softplus's and the clamp's derivative (torch).


@dataclass(frozen=True)
class SSDGradTiles:
    """The training SSD's settings (besides the forward kernels' SSDTiles)."""

    chunk: int  # steps a chunk, a power of two >= 16: the backward holds a chunk's (Q, Q) products in registers
    warps: int  # the backward kernels' warps


@jit
def _chunk_program(T, n_chunks, heads_per_group, Q: tl.constexpr, PP: tl.constexpr, NP: tl.constexpr):
    """The backward kernels' program: row b (int64), chunk c, head h and its group g; the
    chunk's steps q, their times t and which are steps (tm); a head's channels p and the
    states n (padded to PP, NP)."""
    b64 = (tl.program_id(0) // n_chunks).to(tl.int64)
    c = tl.program_id(0) % n_chunks
    h = tl.program_id(1)
    q = tl.arange(0, Q)
    t = c * Q + q
    return b64, c, h, h // heads_per_group, q, t, t < T, tl.arange(0, PP), tl.arange(0, NP)


@jit
def _ssd_bwd_dstart_kernel(
    dy_ptr, C_ptr, cum_ptr, first_ptr, out_ptr, T, n_chunks, heads_per_group,
    H: tl.constexpr, P: tl.constexpr, N: tl.constexpr, G: tl.constexpr, Q: tl.constexpr, PP: tl.constexpr,
    NP: tl.constexpr, RESETS: tl.constexpr,
):
    # One program: row b, chunk c, head h: Y = sum_t exp(cum_t) dy_t (outer) C_t over the
    # chunk's steps (with RESETS, those before the chunk's first reset), into (B, chunks, H, P, N).
    b64, c, h, g, q, t, tm, p, n = _chunk_program(T, n_chunks, heads_per_group, Q, PP, NP)
    w = tl.exp(tl.load(cum_ptr + ((b64 * n_chunks + c) * Q + q) * H + h))
    if RESETS:
        w = tl.where(tl.load(first_ptr + b64 * T + t, mask=tm, other=0) < c * Q, w, 0.0)
    dy = tl.load(dy_ptr + ((b64 * T + t[None, :]) * H + h) * P + p[:, None], mask=tm[None, :] & (p < P)[:, None],
                 other=0.0)  # (PP, Q)
    Cq = tl.load(C_ptr + ((b64 * T + t[:, None]) * G + g) * N + n[None, :], mask=tm[:, None] & (n < N)[None, :],
                 other=0.0)  # (Q, NP)
    Y = tensor_dot(dy, Cq * w[:, None], tl.zeros([PP, NP], dtype=tl.float32), True)
    tl.store(out_ptr + (((b64 * n_chunks + c) * H + h) * P + p[:, None]) * N + n[None, :], Y,
             mask=(p < P)[:, None] & (n < N)[None, :])


@jit
def _ssd_bwd_chunk_kernel(
    x_ptr, dy_ptr, B_ptr, C_ptr, dt_ptr, cum_ptr, first_ptr, starts_ptr, gend_ptr, A_ptr, D_ptr,
    dx_ptr, dB_ptr, dC_ptr, ddt_ptr, dA_ptr, dD_ptr, T, n_chunks, heads_per_group,
    H: tl.constexpr, P: tl.constexpr, N: tl.constexpr, G: tl.constexpr, Q: tl.constexpr, PP: tl.constexpr,
    NP: tl.constexpr, RESETS: tl.constexpr,
):
    # One program: row b, chunk c, head h, the whole chunk. The forward (ssd_ref's sums),
    # with S the running sum of dt A, M_ts = exp(S_t - S_s) where s reaches t:
    #   y_t   = sum_s M_ts (C_t . B_s) dt_s x_s + exp(S_t) C_t . s_in + D x_t
    #   s_out = exp(S_last) s_in + sum_s exp(S_last - S_s) dt_s x_s (outer) B_s
    # Given dy and g = d s_out, the gradients of x, B, C (this head's share), dt (directly and
    # through S), and this chunk's parts of dA and dD.
    b64, c, h, g, q, t, tm, p, n = _chunk_program(T, n_chunks, heads_per_group, Q, PP, NP)
    qp = tm[:, None] & (p < P)[None, :]
    qn = tm[:, None] & (n < N)[None, :]
    pn = (p < P)[:, None] & (n < N)[None, :]
    xq = tl.load(x_ptr + ((b64 * T + t[:, None]) * H + h) * P + p[None, :], mask=qp, other=0.0)  # (Q, PP)
    dy = tl.load(dy_ptr + ((b64 * T + t[:, None]) * H + h) * P + p[None, :], mask=qp, other=0.0)
    Bq = tl.load(B_ptr + ((b64 * T + t[:, None]) * G + g) * N + n[None, :], mask=qn, other=0.0)  # (Q, NP)
    Cq = tl.load(C_ptr + ((b64 * T + t[:, None]) * G + g) * N + n[None, :], mask=qn, other=0.0)
    dt = tl.load(dt_ptr + (b64 * T + t) * H + h, mask=tm, other=0.0)  # (Q,) (0 past T)
    cum_row = cum_ptr + (b64 * n_chunks + c) * Q * H + h
    cum = tl.load(cum_row + q * H)  # (past T it stays at the last step's: dt is 0 there)
    last = tl.load(cum_row + (Q - 1) * H)
    state_at = (((b64 * n_chunks + c) * H + h) * P + p[:, None]) * N + n[None, :]
    s_in = tl.load(starts_ptr + state_at, mask=pn, other=0.0)  # (PP, NP)
    gs = tl.load(gend_ptr + state_at, mask=pn, other=0.0)
    A = tl.load(A_ptr + h)
    reach = q[None, :] <= q[:, None]  # (t, s)
    from_in = tl.exp(cum)  # s_in's decay to each step
    to_end = tl.exp(last - cum)  # each step's decay to s_out
    decay = tl.exp(last)
    if RESETS:
        f = tl.load(first_ptr + b64 * T + t, mask=tm, other=-1)
        f_last = tl.load(first_ptr + b64 * T + tl.minimum(c * Q + Q - 1, T - 1))
        reach = reach & (f[None, :] == f[:, None])
        from_in = tl.where(f < c * Q, from_in, 0.0)
        to_end = tl.where(f == f_last, to_end, 0.0)
        decay = tl.where(f_last < c * Q, decay, 0.0)
    M = tl.where(reach, tl.exp(tl.minimum(cum[:, None] - cum[None, :], 0.0)), 0.0)  # (t, s)
    zqq = tl.zeros([Q, Q], dtype=tl.float32)
    CB = tensor_dot(Cq, tl.trans(Bq), zqq, True)  # C_t . B_s
    DX = tensor_dot(dy, tl.trans(xq), zqq, True)  # dy_t . x_s
    W = M * dt[None, :]
    gB = tensor_dot(Bq, tl.trans(gs), tl.zeros([Q, PP], dtype=tl.float32), True)  # (g B_s)_p
    xg = tensor_dot(xq, gs, tl.zeros([Q, NP], dtype=tl.float32), True)  # (x_s g)_n
    dys = tensor_dot(dy, s_in, tl.zeros([Q, NP], dtype=tl.float32), True)  # (dy_t s_in)_n
    w_end = to_end * dt
    dx = tensor_dot(tl.trans(W * CB), dy, tl.zeros([Q, PP], dtype=tl.float32), True) + w_end[:, None] * gB \
        + tl.load(D_ptr + h) * dy
    WDX = W * DX
    dB = tensor_dot(tl.trans(WDX), Cq, tl.zeros([Q, NP], dtype=tl.float32), True) + w_end[:, None] * xg
    dC = tensor_dot(WDX, Bq, tl.zeros([Q, NP], dtype=tl.float32), True) + from_in[:, None] * dys
    MCD = M * CB * DX
    xgB = tl.sum(xq * gB, 1)  # x_s . (g B_s)
    Tm = MCD * dt[None, :]
    E = w_end * xgB
    # d/dS: each term's exponent (S_t - S_s, S_t, S_last - S_s, S_last)
    dS = tl.sum(Tm, 1) - tl.sum(Tm, 0) + from_in * tl.sum(Cq * dys, 1) - E
    dS += tl.where(q == Q - 1, tl.sum(E, 0) + decay * tl.sum(tl.sum(s_in * gs, 1), 0), 0.0)
    R = tl.sum(tl.where(q[:, None] >= q[None, :], dS[:, None], 0.0), 0)  # R_k = sum_{t >= k} dS_t: d(dt_k A)
    ddt = tl.sum(MCD, 0) + to_end * xgB + A * R
    out = ((b64 * T + t) * H + h)
    tl.store(dx_ptr + out[:, None] * P + p[None, :], dx, mask=qp)
    tl.store(dB_ptr + out[:, None] * N + n[None, :], dB, mask=qn)
    tl.store(dC_ptr + out[:, None] * N + n[None, :], dC, mask=qn)
    tl.store(ddt_ptr + out, ddt, mask=tm)
    tl.store(dA_ptr + (b64 * n_chunks + c) * H + h, tl.sum(dt * R, 0))
    tl.store(dD_ptr + (b64 * n_chunks + c) * H + h, tl.sum(tl.sum(dy * xq, 1), 0))


def _chunk_of(T: int, tiles: SSDGradTiles) -> int:
    return min(tiles.chunk, max(16, triton.next_power_of_2(T)))


def _ssd_forward(x, dt, dt_bias, dt_limit, A, Bm, Cm, D, state, first, Q: int, tiles: SSDTiles):
    """ssd.ssd_scan's chunked forward in chunks of Q steps, float32 and contiguous inputs:
    y (B, T, H, P), the new state, and what the backward reads (the step sizes (B, T, H),
    their running sums (B, chunks, Q, H), the state each chunk starts from (B, chunks, H, P, N))."""
    Bsz, T, H, P = x.shape
    G, N = Bm.shape[2], Bm.shape[3]
    n_chunks = triton.cdiv(T, Q)
    dev = x.device
    steps = torch.empty(Bsz, T, H, device=dev, dtype=torch.float32)
    cum = torch.empty(Bsz, n_chunks, Q, H, device=dev, dtype=torch.float32)
    _ssd_step_sizes_kernel[(Bsz * n_chunks, triton.cdiv(H, tiles.sizes_bh))](
        dt, dt.stride(0), dt.stride(1), dt_bias, A, dt_bias, steps, cum, T, n_chunks,
        float(dt_limit[0]), float(dt_limit[1]), H=H, Q=Q, BH=tiles.sizes_bh, START=False, num_warps=4,
    )
    states = torch.empty(Bsz, n_chunks, H, P, N, device=dev, dtype=torch.float32)
    starts = torch.empty(Bsz, n_chunks, H, P, N, device=dev, dtype=torch.float32)
    new = state.clone()
    y = torch.empty(Bsz, T, H, P, device=dev, dtype=torch.float32)
    resets = first is not None
    first = first if resets else cum  # (unread without resets)
    BP, NP = max(16, triton.next_power_of_2(P)), max(16, triton.next_power_of_2(N))
    BS = min(tiles.bs, Q)
    common = dict(H=H, P=P, N=N, Q=Q, NP=NP, F32=True, RESETS=resets)
    _ssd_chunk_state_kernel[(Bsz * n_chunks, H, triton.cdiv(P, min(BP, tiles.state_bp)))](
        x, x.stride(0), x.stride(1), Bm, Bm.stride(0), Bm.stride(1), steps, cum, first, states, T, n_chunks, H // G,
        BS=BS, BP=min(BP, tiles.state_bp), **common, num_warps=4,
    )
    _ssd_state_passing_kernel[(triton.cdiv(P * N, tiles.pass_bl), H, Bsz)](
        states, starts, new, cum, first, T, n_chunks, H=H, PN=P * N, Q=Q, BL=tiles.pass_bl,
        CB=min(tiles.pass_cb, triton.next_power_of_2(n_chunks)), RESETS=resets, num_warps=tiles.pass_warps,
    )
    BT = min(tiles.bt, Q)
    _ssd_chunk_scan_kernel[(Bsz * n_chunks, H, Q // BT)](
        x, x.stride(0), x.stride(1), Bm, Cm, Bm.stride(0), Bm.stride(1), steps, cum, first, starts, D, y, states, T,
        n_chunks, H // G, BT=BT, BS=BS, BP=BP, **common, CB_ONCE=False, G=G, num_warps=tiles.scan_warps,
        num_stages=tiles.scan_stages,
    )
    return y, new, steps, cum, starts


class _SSDTrain(torch.autograd.Function):
    """Under autocast its inputs come in float32 (the kernels' dtype; custom_fwd). Its sums
    need no atomics: each program writes its own gradients and its parts of A's and D's,
    which torch adds up, so the backward is the same bits run to run."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda", cast_inputs=torch.float32)
    def forward(ctx, x, dt, dt_bias, A, Bm, Cm, D, state, resets, dt_limit, tiles, grad_tiles):
        Bsz, T, H, P = x.shape
        Q = _chunk_of(T, grad_tiles)
        f32 = [v.detach().float().contiguous() for v in (x, dt, dt_bias, A, Bm, Cm, D, state)]
        first = segment_starts(resets, 0).to(torch.int32).contiguous() if resets is not None else None
        xf, dtf, biasf, Af, Bf, Cf, Df, statef = f32
        y, new, steps, cum, starts = _ssd_forward(xf, dtf, biasf, dt_limit, Af, Bf, Cf, Df, statef, first, Q, tiles)
        ctx.save_for_backward(*f32[:7], steps, cum, starts, first)
        ctx.dt_limit, ctx.Q, ctx.grad_tiles = dt_limit, Q, grad_tiles
        ctx.dtypes = [v.dtype for v in (x, dt, dt_bias, A, Bm, Cm, D, state)]
        return y, new

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    def backward(ctx, dy, dnew):
        x, dt_raw, dt_bias, A, Bm, Cm, D, steps, cum, starts, first = ctx.saved_tensors
        Q, tiles = ctx.Q, ctx.grad_tiles
        Bsz, T, H, P = x.shape
        G, N = Bm.shape[2], Bm.shape[3]
        n_chunks = cum.shape[1]
        dev = x.device
        dy = torch.zeros_like(x) if dy is None else dy.float().contiguous()
        g = torch.zeros_like(starts[:, 0]) if dnew is None else dnew.float()
        resets = first is not None
        first_arg = first if resets else cum
        PP, NP = max(16, triton.next_power_of_2(P)), max(16, triton.next_power_of_2(N))
        sizes = dict(H=H, P=P, N=N, G=G, Q=Q, PP=PP, NP=NP, RESETS=resets)
        own = torch.empty_like(starts)  # Y_c
        _ssd_bwd_dstart_kernel[(Bsz * n_chunks, H)](
            dy, Cm, cum, first_arg, own, T, n_chunks, H // G, **sizes, num_warps=tiles.warps,
        )
        # the gradient of each chunk's end state, from the last chunk back
        decay = torch.exp(cum[:, :, Q - 1])  # (B, chunks, H)
        if resets:
            ends = torch.clamp(torch.arange(n_chunks, device=dev) * Q + Q - 1, max=T - 1)
            decay = decay * (first[:, ends] < torch.arange(n_chunks, device=dev) * Q)[..., None]
        g_end = torch.empty_like(starts)
        for c in reversed(range(n_chunks)):
            g_end[:, c] = g
            g = decay[:, c, :, None, None] * g + own[:, c]
        dx = torch.empty_like(x)
        dB = torch.empty(Bsz, T, H, N, device=dev, dtype=torch.float32)
        dC = torch.empty_like(dB)
        ddt = torch.empty(Bsz, T, H, device=dev, dtype=torch.float32)
        dA = torch.empty(Bsz, n_chunks, H, device=dev, dtype=torch.float32)
        dD = torch.empty_like(dA)
        _ssd_bwd_chunk_kernel[(Bsz * n_chunks, H)](
            x, dy, Bm, Cm, steps, cum, first_arg, starts, g_end, A, D, dx, dB, dC, ddt, dA, dD, T, n_chunks, H // G,
            **sizes, num_warps=tiles.warps,
        )
        # softplus's derivative, where the clamp passes it
        z = dt_raw + dt_bias
        lo, hi = ctx.dt_limit
        sp = F.softplus(z)
        dz = ddt * torch.sigmoid(z) * ((sp >= lo) & (sp <= hi))
        grads = [dx, dz, dz.sum((0, 1)), dA.sum((0, 1)), dB.view(Bsz, T, G, H // G, N).sum(3),
                 dC.view(Bsz, T, G, H // G, N).sum(3), dD.sum((0, 1)), g]
        return (*(d.to(dtype) for d, dtype in zip(grads, ctx.dtypes)), None, None, None, None)


def ssd_scan_train_triton(x, dt, dt_bias, dt_limit, A, Bm, Cm, D, state, chunk: int, start=None, resets=None, *,
                          tiles: SSDTiles, grad_tiles: SSDGradTiles) -> torch.Tensor:
    """Triton twin of `ssd_scan_train` (the same arguments; `chunk` is grad_tiles.chunk's
    choice, the same sums): the chunked forward kernels of kernels/ssd.py and the backward
    above, an autograd Function. No left padding (a training pass has none). tiles: the
    forward kernels' launch settings; grad_tiles: the chunk and the backward's warps (the
    plan's, engine/plan.SSD_GRAD_TILES)."""
    if start is not None:
        raise ValueError("ssd_scan_train_triton takes no left padding (start)")
    y, new = _SSDTrain.apply(x, dt, dt_bias, A, Bm, Cm, D, state, resets, tuple(dt_limit), tiles, grad_tiles)
    state.copy_(new)
    return y
