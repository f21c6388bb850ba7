"""The Mamba-1 layer (state-spaces Mamba, HF `MambaForCausalLM`, Falcon-Mamba, Jamba's Mamba
layers) over `Ops`: its weights, its tensors and their shapes, and its mixer, the one recurrent
core of the language model and of fastmamba.Backbone.

Per layer, per token, with h the residual stream (d = d_model, E = d_inner, N = d_state,
R = dt_rank, K = d_conv):
```
u         = rmsnorm(h) * norm.w
x, z      = split(in_proj(u), [E, E])
x         = silu(causal depthwise conv over time (K taps) of x)   # conv state (E, K)
dt_r, B, C = split(x_proj(x), [R, N, N])                          # Falcon-Mamba, Jamba: each RMS-normalised
dt        = softplus(dt_proj(dt_r) + dt_bias)
s         = s * exp(dt * A) + (dt * x) (outer) B                   # ssm state (E, N)
y         = (s @ C + D * x) * silu(z)
h         = h + out_proj(y)
```
One definition for every storage dtype: the large matrices stay in their storage dtype and
are upcast per product, so every product accumulates in float32 (docs/architecture.md), as do
the residual stream, the conv and ssm states, and the logits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fastmamba.core import fp8
from fastmamba.core.ops import REFERENCE_OPS, Ops, linear
from fastmamba.kernels.causal_conv1d import causal_conv1d_ref


@dataclass
class LayerWeights:
    norm_w: torch.Tensor  # (d,) f32
    in_proj_w: torch.Tensor  # (2E, d) storage dtype
    in_proj_b: torch.Tensor | None  # (2E,) f32
    conv_w: torch.Tensor  # (E, K) f32
    conv_b: torch.Tensor | None  # (E,) f32
    x_proj_w: torch.Tensor  # (R+2N, E) storage dtype
    dt_proj_w: torch.Tensor  # (E, R) storage dtype
    dt_bias: torch.Tensor  # (E,) f32
    A: torch.Tensor  # (E, N) f32, -exp(A_log) computed once at load
    D: torch.Tensor  # (E,) f32
    out_proj_w: torch.Tensor  # (d, E) storage dtype
    out_proj_b: torch.Tensor | None  # (d,) f32
    # Jamba: the weights of dt_r's, B's and C's RMSNorms ((R,), (N,), (N,) f32); None: unweighted
    # (Falcon-Mamba) or no such norm (config.dbc_norm_eps None)
    dbc_norm_w: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None


def rms_unweighted(t: torch.Tensor, eps: float) -> torch.Tensor:
    """t / rms(t) over the last dimension, in float32: Falcon-Mamba's norm of x_proj's
    dt_r, B and C (it has no weight)."""
    t = t.float()
    return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + eps)


def _dbc_norms(config, lw: LayerWeights, dt_r, Bm, Cm):
    """x_proj's dt_r, B and C each RMS-normalised where the config says (Falcon-Mamba, Jamba),
    times its norm's weight where the layer has one (Jamba)."""
    if config.dbc_norm_eps is None:
        return dt_r, Bm, Cm
    normed = [rms_unweighted(t, config.dbc_norm_eps) for t in (dt_r, Bm, Cm)]
    if lw.dbc_norm_w is not None:
        normed = [t * w for t, w in zip(normed, lw.dbc_norm_w)]
    return normed


def in_proj_dtype(weight_dtype: torch.dtype) -> torch.dtype:
    """The dtype of in_proj's output (x before the conv, z before the gate) on the GPU path.
    bfloat16 for bfloat16 weights: it has float32's range, so nothing overflows, and what
    these values feed is rounded to bfloat16 anyway (the conv's output, the gated y).
    bfloat16 for FP8 weights too: cuBLASLt's FP8 GEMM writes bfloat16 (kernels/fp8_gemm.fp8_linear),
    so a float32 copy would hold the same values at twice the bytes, and cost a pass over
    them (2.8b's 8192-token prefill: 0.5 GB a layer). float32 otherwise: float16's range
    could overflow on the public checkpoints' magnitudes (docs/architecture.md). (CPU
    emulation, 256-token prompts, logits' largest difference over their largest: the bundled
    model 4.3e-3 from the float32-math reference with bfloat16 weights against 8.4e-3 with
    these rounded too; transformers' bfloat16 model 1.1e-2. benchmarks/RESULTS.md, "Numerics".)"""
    return torch.bfloat16 if weight_dtype in (torch.bfloat16, torch.float8_e4m3fn) else torch.float32


def mixer(
    config, lw: LayerWeights, u: torch.Tensor, conv_state, ssm_state, ops: Ops = REFERENCE_OPS, start=None, resets=None
) -> torch.Tensor:
    """One layer's mixer over T new tokens, continuing from and updating the layer's state:
    the one recurrent core of the language model and of fastmamba.Backbone.

    config: the sizes (a MambaConfig or BackboneConfig: d_inner, d_state, dt_rank, dbc_norm_eps).
    u (B, T, d) f32 -> (B, T, d) f32. A decode step is the same call with T = 1.
    start (B,): left padding, see kernels/causal_conv1d.py.
    resets (B, T) bool: the row's state is zero before step t.
    """
    if ops is REFERENCE_OPS and u.shape[1] == 1 and start is None and resets is None and not torch.is_grad_enabled():
        return _mixer_step_ref(config, lw, u, conv_state, ssm_state)
    extra = {} if resets is None else {"resets": resets}
    E, N, R = config.d_inner, config.d_state, config.dt_rank
    xz = ops.linear(u, lw.in_proj_w, lw.in_proj_b, in_proj_dtype(lw.in_proj_w.dtype))  # (B, T, 2E)
    x, z = xz.transpose(1, 2).split([E, E], dim=1)  # (B, E, T) each
    # the conv's output in x_proj's dtype (GPU path; the reference keeps f32): x_proj's
    # operand, and the scan's input
    x = ops.conv(x, lw.conv_w, lw.conv_b, conv_state, start, lw.x_proj_w.dtype, **extra)  # (B, E, T)
    dt_r, Bm, Cm = ops.linear(x.transpose(1, 2), lw.x_proj_w).split([R, N, N], dim=-1)  # (B, T, R|N|N)
    dt_r, Bm, Cm = _dbc_norms(config, lw, dt_r, Bm, Cm)
    y = ops.scan(
        x, dt_r, fp8.dense(lw.dt_proj_w), lw.dt_bias, lw.A, Bm.transpose(1, 2), Cm.transpose(1, 2), lw.D, z,
        ssm_state, start,
        out_dtype=lw.out_proj_w.dtype,  # y as out_proj reads it (GPU path; the reference keeps f32)
        **extra,
    )  # (B, E, T)
    return ops.linear(y.transpose(1, 2), lw.out_proj_w, lw.out_proj_b)


def _mixer_step_ref(config, lw: LayerWeights, u: torch.Tensor, conv_state, ssm_state) -> torch.Tensor:
    """`mixer` for one token on the reference ops: the conv through causal_conv1d_ref, then
    the arithmetic of step_size_ref and one step of selective_scan_ref without the sequence
    machinery (transposes, the time loop, the state's copy), whose small-tensor calls cost
    more than the arithmetic on the CPU. Without autograd only: it updates the states in
    place after reading them, where autograd would have saved them for the backward.
    u (B, 1, d) -> (B, 1, d) f32; updates both states (read in float32, stored in theirs)."""
    E, N, R = config.d_inner, config.d_state, config.dt_rank
    xz = linear(u[:, 0], lw.in_proj_w, lw.in_proj_b)  # (B, 2E)
    x, z = xz[:, :E], xz[:, E:]
    xc = causal_conv1d_ref(x[:, :, None], lw.conv_w, lw.conv_b, conv_state)[:, :, 0]  # its one-step window
    dt_r, Bm, Cm = _dbc_norms(config, lw, *linear(xc, lw.x_proj_w).split([R, N, N], dim=-1))  # (B, R|N|N)
    delta = F.softplus(linear(dt_r, lw.dt_proj_w, lw.dt_bias))  # (B, E)
    decay, gain = torch.exp(delta[:, :, None] * lw.A), (delta * xc)[:, :, None]
    if ssm_state.dtype == torch.float32:  # in place: fewer small calls
        s = ssm_state.mul_(decay).addcmul_(gain, Bm[:, None, :])
    else:  # a 16-bit state: the update in float32, rounded once on store
        s = torch.addcmul(ssm_state.float() * decay, gain, Bm[:, None, :])
        ssm_state.copy_(s)
    y = torch.addcmul(torch.bmm(s, Cm[:, :, None])[:, :, 0], lw.D, xc)
    return linear(y * F.silu(z), lw.out_proj_w, lw.out_proj_b)[:, None]


def mamba1_shapes(c, norm: str, p: str, dbc_norms: tuple[str, ...] = ()) -> dict[str, tuple[int, ...]]:
    """A Mamba-1 sublayer's tensors (HF names: its norm's, its mixer's under prefix p, e.g.
    'backbone.layers.{i}.mixer.') and their shapes; dbc_norms: the names of dt_r's, B's and
    C's norms, where the layer weighs them (Jamba's)."""
    E, R, N, K, d = c.d_inner, c.dt_rank, c.d_state, c.d_conv, c.d_model
    shapes = {
        norm: (d,),
        p + "in_proj.weight": (2 * E, d),
        p + "conv1d.weight": (E, 1, K),
        p + "x_proj.weight": (R + 2 * N, E),
        p + "dt_proj.weight": (E, R),
        p + "dt_proj.bias": (E,),
        p + "A_log": (E, N),
        p + "D": (E,),
        p + "out_proj.weight": (d, E),
    }
    if c.conv_bias:
        shapes[p + "conv1d.bias"] = (E,)
    if c.proj_bias:
        shapes[p + "in_proj.bias"] = (2 * E,)
        shapes[p + "out_proj.bias"] = (d,)
    for name, n in zip(dbc_norms, (R, N, N)):
        shapes[p + name + ".weight"] = (n,)
    return shapes


def mamba1_weights(norm: str, p: str, big, small, dbc_norms: tuple[str, ...] = ()) -> LayerWeights:
    """The sublayer's weights from its checked tensors: `big(name)` in the storage dtype,
    `small(name)` in float32 (None where absent); dbc_norms as mamba1_shapes'."""
    return LayerWeights(
        norm_w=small(norm),
        in_proj_w=big(p + "in_proj.weight"),
        in_proj_b=small(p + "in_proj.bias"),
        conv_w=small(p + "conv1d.weight")[:, 0, :],
        conv_b=small(p + "conv1d.bias"),
        x_proj_w=big(p + "x_proj.weight"),
        dt_proj_w=big(p + "dt_proj.weight"),
        dt_bias=small(p + "dt_proj.bias"),
        A=-torch.exp(small(p + "A_log")),
        D=small(p + "D"),
        out_proj_w=big(p + "out_proj.weight"),
        out_proj_b=small(p + "out_proj.bias"),
        dbc_norm_w=tuple(small(p + name + ".weight") for name in dbc_norms) or None,
    )
