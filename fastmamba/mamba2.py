"""The Mamba-2 (SSD) layer in pure PyTorch: the CPU engine and the oracle for kernels to come.

Per layer, with h the residual stream (d = d_model, E = d_inner = H heads x P head_dim,
G groups of B and C of N = d_state each, K = d_conv):
```
u            = rmsnorm(h) * norm.w
z, xBC, dt   = split(in_proj(u), [E, E + 2GN, H])
xBC          = silu(causal depthwise conv over time (K taps) of xBC)   # conv state (E + 2GN, K)
x, B, C      = split(xBC, [E, GN, GN])                   # x: H heads of P; B, C: G groups of N
dt           = clamp(softplus(dt + dt_bias), dt_limit)   # (H,) a step
s            = s * exp(dt * A) + dt * x (outer) B_g      # (H, P, N); head h reads group h // (H / G)
y            = s @ C_g + D * x                           # (H, P)
y            = rmsnorm_by_group(y * silu(z)) * norm.w    # gated, G groups (norm_before_gate: rmsnorm(y) * silu(z))
h            = h + out_proj(y)
```
A prefill runs the same recurrence in chunks of `chunk_size` steps (SSD): inside a chunk
the outputs are a masked product of C and B (quadratic in the chunk's length), and only
the chunk's end state passes on to the next chunk. Left padding (`start`) leaves a row's
state untouched: a padded step has dt = 0 (no decay, no input) and a zero conv input.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .kernels.causal_conv1d import causal_conv1d_ref


@dataclass
class Mamba2LayerWeights:
    norm_w: torch.Tensor  # (d,) f32
    in_proj_w: torch.Tensor  # (2E + 2GN + H, d) storage dtype: z, xBC, dt
    in_proj_b: torch.Tensor | None  # f32
    conv_w: torch.Tensor  # (E + 2GN, K) f32
    conv_b: torch.Tensor | None  # (E + 2GN,) f32
    dt_bias: torch.Tensor  # (H,) f32
    A: torch.Tensor  # (H,) f32, -exp(A_log)
    D: torch.Tensor  # (H,) f32
    gate_norm_w: torch.Tensor  # (E,) f32, the gated norm's weight
    out_proj_w: torch.Tensor  # (d, E) storage dtype
    out_proj_b: torch.Tensor | None  # (d,) f32


def shapes(c, p: str) -> dict[str, tuple[int, ...]]:
    """Layer `p`'s tensors (HF names, prefix p = 'backbone.layers.{i}.') and their shapes."""
    E, N, G, H, K, d = c.d_inner, c.d_state, c.n_groups, c.n_heads, c.d_conv, c.d_model
    out = {
        p + "norm.weight": (d,),
        p + "mixer.in_proj.weight": (2 * E + 2 * G * N + H, d),
        p + "mixer.conv1d.weight": (E + 2 * G * N, 1, K),
        p + "mixer.dt_bias": (H,),
        p + "mixer.A_log": (H,),
        p + "mixer.D": (H,),
        p + "mixer.norm.weight": (E,),
        p + "mixer.out_proj.weight": (d, E),
    }
    if c.conv_bias:
        out[p + "mixer.conv1d.bias"] = (E + 2 * G * N,)
    if c.proj_bias:
        out[p + "mixer.in_proj.bias"] = (2 * E + 2 * G * N + H,)
        out[p + "mixer.out_proj.bias"] = (d,)
    return out


def layer_weights(p: str, big, small) -> Mamba2LayerWeights:
    """Layer p's weights from its checked tensors: `big(name)` in the storage dtype, `small(name)`
    in float32 (None where absent)."""
    return Mamba2LayerWeights(
        norm_w=small(p + "norm.weight"),
        in_proj_w=big(p + "mixer.in_proj.weight"),
        in_proj_b=small(p + "mixer.in_proj.bias"),
        conv_w=small(p + "mixer.conv1d.weight")[:, 0, :],
        conv_b=small(p + "mixer.conv1d.bias"),
        dt_bias=small(p + "mixer.dt_bias"),
        A=-torch.exp(small(p + "mixer.A_log")),
        D=small(p + "mixer.D"),
        gate_norm_w=small(p + "mixer.norm.weight"),
        out_proj_w=big(p + "mixer.out_proj.weight"),
        out_proj_b=small(p + "mixer.out_proj.bias"),
    )


def state_shapes(c) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """One slot's conv state (E + 2GN, K) and ssm state (H, P, N)."""
    return (c.d_inner + 2 * c.n_groups * c.d_state, c.d_conv), (c.n_heads, c.head_dim, c.d_state)


def _linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x.float(), w.float(), b)


def mixer2(config, lw: Mamba2LayerWeights, u: torch.Tensor, conv_state, ssm_state, ops=None, start=None,
           resets=None) -> torch.Tensor:
    """One Mamba-2 layer's mixer over T new tokens, continuing from and updating the layer's
    state: u (B, T, d) f32 -> (B, T, d) f32. `ops` is the Mamba-1 kernels' choice, which
    this reference layer does not use. start (B,): left padding."""
    if resets is not None:
        raise ValueError("Mamba-2 layers take no resets")
    c = config
    E, N, G, H, P = c.d_inner, c.d_state, c.n_groups, c.n_heads, c.head_dim
    Bsz, T, _ = u.shape
    zxbcdt = _linear(u, lw.in_proj_w, lw.in_proj_b)  # (B, T, 2E + 2GN + H)
    z, xbc, dt = zxbcdt.split([E, E + 2 * G * N, H], dim=-1)
    xbc = causal_conv1d_ref(xbc.transpose(1, 2), lw.conv_w, lw.conv_b, conv_state, start).transpose(1, 2)
    x, Bm, Cm = xbc.split([E, G * N, G * N], dim=-1)
    dt = F.softplus(dt + lw.dt_bias).clamp(*c.dt_limit)  # (B, T, H)
    if start is not None:  # padded steps: no decay, no input
        dt = dt * (torch.arange(T, device=u.device)[None, :] >= start[:, None].long())[..., None]
    y = ssd_ref(x.reshape(Bsz, T, H, P), dt, lw.A, Bm.reshape(Bsz, T, G, N), Cm.reshape(Bsz, T, G, N), lw.D,
                ssm_state, c.chunk_size)  # (B, T, H, P)
    y = gated_rmsnorm(y.reshape(Bsz, T, E), z, lw.gate_norm_w, G, c.norm_eps, c.norm_before_gate)
    return _linear(y, lw.out_proj_w, lw.out_proj_b)


def gated_rmsnorm(y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, groups: int, eps: float,
                  norm_before_gate: bool = False) -> torch.Tensor:
    """RMSNorm over each of `groups` equal parts of the last dimension, gated by silu(z):
    of y * silu(z) (norm_before_gate False, every public checkpoint), else norm(y) * silu(z)."""
    gate = F.silu(z.float())
    h = y.float() if norm_before_gate else y.float() * gate
    parts = h.unflatten(-1, (groups, -1))
    h = (parts * torch.rsqrt(parts.pow(2).mean(-1, keepdim=True) + eps)).flatten(-2) * weight
    return h * gate if norm_before_gate else h


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
