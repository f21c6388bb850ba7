"""The Mamba-2 (SSD) layer over `core/ops.Ops`: the pure-PyTorch twins on the reference engine,
cuBLAS and the Triton kernels (kernels/ssd.py, kernels/gated_norm.py) on the GPU engine.

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

from fastmamba.core.fp8 import operand_dtype


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
    gate_norm_w: torch.Tensor | None  # (E,) f32, the gated norm's weight (None: no norm, y * silu(z))
    out_proj_w: torch.Tensor  # (d, E) storage dtype
    out_proj_b: torch.Tensor | None  # (d,) f32


def shapes(c, norm: str, p: str) -> dict[str, tuple[int, ...]]:
    """A Mamba-2 sublayer's tensors (HF names: its norm's, its mixer's under prefix p) and
    their shapes."""
    E, N, G, H, K, d = c.d_inner, c.d_state, c.n_groups, c.n_heads, c.d_conv, c.d_model
    out = {
        norm: (d,),
        p + "in_proj.weight": (2 * E + 2 * G * N + H, d),
        p + "conv1d.weight": (E + 2 * G * N, 1, K),
        p + "dt_bias": (H,),
        p + "A_log": (H,),
        p + "D": (H,),
        p + "out_proj.weight": (d, E),
    }
    if c.ssm_norm:
        out[p + "norm.weight"] = (E,)
    if c.conv_bias:
        out[p + "conv1d.bias"] = (E + 2 * G * N,)
    if c.proj_bias:
        out[p + "in_proj.bias"] = (2 * E + 2 * G * N + H,)
        out[p + "out_proj.bias"] = (d,)
    return out


def layer_weights(norm: str, p: str, big, small) -> Mamba2LayerWeights:
    """The sublayer's weights from its checked tensors: `big(name)` in the storage dtype,
    `small(name)` in float32 (None where absent)."""
    return Mamba2LayerWeights(
        norm_w=small(norm),
        in_proj_w=big(p + "in_proj.weight"),
        in_proj_b=small(p + "in_proj.bias"),
        conv_w=small(p + "conv1d.weight")[:, 0, :],
        conv_b=small(p + "conv1d.bias"),
        dt_bias=small(p + "dt_bias"),
        A=-torch.exp(small(p + "A_log")),
        D=small(p + "D"),
        gate_norm_w=small(p + "norm.weight"),
        out_proj_w=big(p + "out_proj.weight"),
        out_proj_b=small(p + "out_proj.bias"),
    )


def state_shapes(c) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """One slot's conv state (E + 2GN, K) and ssm state (H, P, N)."""
    return (c.d_inner + 2 * c.n_groups * c.d_state, c.d_conv), (c.n_heads, c.head_dim, c.d_state)


def mixer2(config, lw: Mamba2LayerWeights, u: torch.Tensor, conv_state, ssm_state, ops, start=None,
           resets=None) -> torch.Tensor:
    """One Mamba-2 layer's mixer over T new tokens, continuing from and updating the layer's
    state: u (B, T, d) -> (B, T, d) f32, through `ops` (core/ops.Ops: the pure-PyTorch twins,
    or cuBLAS and the Triton kernels). start (B,): left padding; resets (B, T) bool: the row's
    conv and ssm states are zero before step t (an episode's or a packed sequence's start)."""
    c = config
    E, N, G, H, P = c.d_inner, c.d_state, c.n_groups, c.n_heads, c.head_dim
    zxbcdt = ops.linear(u, lw.in_proj_w, lw.in_proj_b)  # (B, T, 2E + 2GN + H) float32
    z, xbc, dt = zxbcdt.split([E, E + 2 * G * N, H], dim=-1)
    # the conv's output (x, B, C) in the products' dtype on the GPU path (the scan's operands)
    xbc = ops.conv(xbc.transpose(1, 2), lw.conv_w, lw.conv_b, conv_state, start, lw.in_proj_w.dtype,
                   resets=resets).transpose(1, 2)
    x, Bm, Cm = xbc.split([E, G * N, G * N], dim=-1)
    y = ops.ssd(x.unflatten(-1, (H, P)), dt, lw.dt_bias, c.dt_limit, lw.A, Bm.unflatten(-1, (G, N)),
                Cm.unflatten(-1, (G, N)), lw.D, ssm_state, c.chunk_size, start, resets)  # (B, T, H, P)
    if lw.gate_norm_w is None:  # (Falcon-H1 without its SSM norm)
        y = (y.flatten(-2).float() * F.silu(z.float())).to(operand_dtype(lw.out_proj_w))
    else:
        y = ops.gated_norm(y.flatten(-2), z, lw.gate_norm_w, G, c.norm_eps, c.norm_before_gate, lw.out_proj_w.dtype)
    return ops.linear(y, lw.out_proj_w, lw.out_proj_b)
