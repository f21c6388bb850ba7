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

import torch
import torch.nn.functional as F

from .causal_conv1d import segment_starts


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
