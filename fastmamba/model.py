"""The Mamba-1 model in pure PyTorch: the CPU engine and the oracle for the GPU kernels.

One definition for every storage dtype: the large matrices stay in their storage dtype and
are upcast per product, so every product accumulates in float32 (docs/architecture.md), as do the
residual stream, the conv and ssm states, and the logits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from .config import MambaConfig
from . import mamba2
from .errors import NonFiniteError
from .kernels.causal_conv1d import causal_conv1d_ref
from .kernels.gated_norm import gated_rmsnorm_ref
from .kernels.ssd import ssd_scan_ref
from .kernels.products import linear_storage
from .kernels.rmsnorm import add_norm_ref
from .kernels.selective_scan import step_and_scan_ref


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


@dataclass
class MambaWeights:
    embedding: torch.Tensor  # (V, d) storage dtype
    layers: list  # LayerWeights (Mamba-1) or mamba2.Mamba2LayerWeights
    norm_f: torch.Tensor  # (d,) f32
    lm_head: torch.Tensor  # (V, d) storage dtype; the embedding itself when tied


@dataclass
class MambaState:
    """The recurrent state of every layer for a fixed number of slots (batch rows)."""

    conv: torch.Tensor  # (L, B, E, K) f32: the last K conv inputs, newest last
    ssm: torch.Tensor  # (L, B, E, N) f32

    @classmethod
    def zeros(cls, config, batch: int, device="cpu", dtype=torch.float32) -> "MambaState":
        conv, ssm = layer_kind(config).state(config)  # one slot's, per layer
        return cls(
            conv=torch.zeros(config.n_layer, batch, *conv, device=device, dtype=dtype),
            ssm=torch.zeros(config.n_layer, batch, *ssm, device=device, dtype=dtype),
        )

    @property
    def batch(self) -> int:
        return self.conv.shape[1]

    def reset(self, mask=None) -> None:
        """Zeroes the slots of a sequence boundary: `mask` a (B,) bool tensor (True: reset
        that slot; on the state's device, a masked multiply: no host sync, safe inside a
        CUDA graph), a slot index, or None for all."""
        if isinstance(mask, torch.Tensor):
            if mask.shape != (self.batch,) or mask.dtype != torch.bool:
                raise ValueError(f"mask must be a bool tensor of shape ({self.batch},), got {mask.dtype} {tuple(mask.shape)}")
            keep = (~mask.to(self.conv.device)).to(self.conv.dtype).view(1, -1, 1, 1)
            self.conv.mul_(keep)
            self.ssm.mul_(keep.to(self.ssm.dtype))
            return
        rows = slice(None) if mask is None else mask
        self.conv[:, rows].zero_()
        self.ssm[:, rows].zero_()

    def rows(self, index) -> "MambaState":
        """A copy holding only the given slots."""
        return MambaState(self.conv[:, index].clone(), self.ssm[:, index].clone())


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, out_dtype=None) -> torch.Tensor:
    """x @ weight.T + bias with float32 accumulation whatever the weight's storage dtype.
    out_dtype: kernels/products.linear_storage's output dtype; the reference keeps float32."""
    return F.linear(x.float(), weight.float(), bias)


def rms_unweighted(t: torch.Tensor, eps: float) -> torch.Tensor:
    """t / rms(t) over the last dimension, in float32: Falcon-Mamba's norm of x_proj's
    dt_r, B and C (it has no weight)."""
    t = t.float()
    return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + eps)


def in_proj_dtype(weight_dtype: torch.dtype) -> torch.dtype:
    """The dtype of in_proj's output (x before the conv, z before the gate) on the GPU path.
    bfloat16 for bfloat16 weights: it has float32's range, so nothing overflows, and what
    these values feed is rounded to bfloat16 anyway (the conv's output, the gated y).
    float32 otherwise: float16's range could overflow on the public checkpoints'
    magnitudes (docs/architecture.md). (CPU emulation, 256-token prompts, logits' largest difference
    over their largest: the bundled model 4.3e-3 from the float32-math reference with
    bfloat16 weights against 8.4e-3 with these rounded too; transformers' bfloat16 model
    1.1e-2. benchmarks/RESULTS.md, "Numerics".)"""
    return torch.bfloat16 if weight_dtype == torch.bfloat16 else torch.float32


@dataclass(frozen=True)
class Ops:
    """The operations a sequence pass is made of, so one model definition runs on either
    engine: the pure-PyTorch twins (CPU) or cuBLAS products and Triton kernels (GPU)."""

    linear: Callable
    conv: Callable  # causal_conv1d_ref signature
    scan: Callable  # step_and_scan_ref signature: step sizes softplus(dt_proj(dt_r) + dt_bias), then the scan
    add_norm: Callable  # add_norm_ref signature: (h + o, rmsnorm(h + o)), the norm in a given dtype
    ssd: Callable = ssd_scan_ref  # Mamba-2's scan (kernels/ssd.py)
    gated_norm: Callable = gated_rmsnorm_ref  # Mamba-2's gated norm (kernels/gated_norm.py)


REFERENCE_OPS = Ops(linear, causal_conv1d_ref, step_and_scan_ref, add_norm_ref)


def triton_ops() -> Ops:
    from .kernels.causal_conv1d import causal_conv1d
    from .kernels.gated_norm import gated_rmsnorm
    from .kernels.rmsnorm import add_norm
    from .kernels.selective_scan import step_and_scan
    from .kernels.ssd import ssd_scan

    return Ops(linear_storage, causal_conv1d, step_and_scan, add_norm, ssd_scan, gated_rmsnorm)


def training_ops() -> Ops:
    """The GPU ops whose backward runs in Triton too (fastmamba.Backbone's sequence pass
    under autograd): the conv and the scan as autograd Functions (kernels/conv_grad.py,
    kernels/scan_grad.py), the products and norms as torch ops, all in float32."""
    from .kernels.conv_grad import causal_conv1d_train
    from .kernels.rmsnorm import add_norm_train
    from .kernels.scan_grad import step_and_scan_train

    return Ops(linear, causal_conv1d_train, step_and_scan_train, add_norm_train)


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
    if config.dbc_norm_eps is not None:  # Falcon-Mamba
        dt_r, Bm, Cm = (rms_unweighted(t, config.dbc_norm_eps) for t in (dt_r, Bm, Cm))
    y = ops.scan(
        x, dt_r, lw.dt_proj_w, lw.dt_bias, lw.A, Bm.transpose(1, 2), Cm.transpose(1, 2), lw.D, z, ssm_state, start,
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
    dt_r, Bm, Cm = linear(xc, lw.x_proj_w).split([R, N, N], dim=-1)  # (B, R|N|N)
    if config.dbc_norm_eps is not None:  # Falcon-Mamba
        dt_r, Bm, Cm = (rms_unweighted(t, config.dbc_norm_eps) for t in (dt_r, Bm, Cm))
    delta = F.softplus(linear(dt_r, lw.dt_proj_w, lw.dt_bias))  # (B, E)
    decay, gain = torch.exp(delta[:, :, None] * lw.A), (delta * xc)[:, :, None]
    if ssm_state.dtype == torch.float32:  # in place: fewer small calls
        s = ssm_state.mul_(decay).addcmul_(gain, Bm[:, None, :])
    else:  # a 16-bit state: the update in float32, rounded once on store
        s = torch.addcmul(ssm_state.float() * decay, gain, Bm[:, None, :])
        ssm_state.copy_(s)
    y = torch.addcmul(torch.bmm(s, Cm[:, :, None])[:, :, 0], lw.D, xc)
    return linear(y * F.silu(z), lw.out_proj_w, lw.out_proj_b)[:, None]


def mamba1_shapes(c, p: str) -> dict[str, tuple[int, ...]]:
    """A Mamba-1 layer's tensors (HF names, prefix p = 'backbone.layers.{i}.') and their shapes."""
    E, R, N, K, d = c.d_inner, c.dt_rank, c.d_state, c.d_conv, c.d_model
    shapes = {
        p + "norm.weight": (d,),
        p + "mixer.in_proj.weight": (2 * E, d),
        p + "mixer.conv1d.weight": (E, 1, K),
        p + "mixer.x_proj.weight": (R + 2 * N, E),
        p + "mixer.dt_proj.weight": (E, R),
        p + "mixer.dt_proj.bias": (E,),
        p + "mixer.A_log": (E, N),
        p + "mixer.D": (E,),
        p + "mixer.out_proj.weight": (d, E),
    }
    if c.conv_bias:
        shapes[p + "mixer.conv1d.bias"] = (E,)
    if c.proj_bias:
        shapes[p + "mixer.in_proj.bias"] = (2 * E,)
        shapes[p + "mixer.out_proj.bias"] = (d,)
    return shapes


def mamba1_weights(p: str, big, small) -> LayerWeights:
    """Layer p's weights from its checked tensors: `big(name)` in the storage dtype,
    `small(name)` in float32 (None where absent)."""
    return LayerWeights(
        norm_w=small(p + "norm.weight"),
        in_proj_w=big(p + "mixer.in_proj.weight"),
        in_proj_b=small(p + "mixer.in_proj.bias"),
        conv_w=small(p + "mixer.conv1d.weight")[:, 0, :],
        conv_b=small(p + "mixer.conv1d.bias"),
        x_proj_w=big(p + "mixer.x_proj.weight"),
        dt_proj_w=big(p + "mixer.dt_proj.weight"),
        dt_bias=small(p + "mixer.dt_proj.bias"),
        A=-torch.exp(small(p + "mixer.A_log")),
        D=small(p + "mixer.D"),
        out_proj_w=big(p + "mixer.out_proj.weight"),
        out_proj_b=small(p + "mixer.out_proj.bias"),
    )


@dataclass(frozen=True)
class LayerKind:
    """What a model family's recurrent layer is: its mixer (the `mixer` signature), its
    tensors and their shapes, its weights from them, and one slot's conv and ssm state shapes."""

    mixer: Callable
    shapes: Callable  # (config, prefix) -> {HF name: shape}
    weights: Callable  # (prefix, big, small) -> the layer's weights
    state: Callable  # config -> (conv state shape, ssm state shape) of one slot
    gpu_kernels: bool  # whether the Triton engine runs it


# The one table of layer kinds (MambaConfig.layer); a hybrid model's attention layers
# would be another row.
LAYER_KINDS = {
    "mamba1": LayerKind(mixer=mixer, shapes=mamba1_shapes, weights=mamba1_weights,
                        state=lambda c: ((c.d_inner, c.d_conv), (c.d_inner, c.d_state)), gpu_kernels=True),
    "mamba2": LayerKind(mixer=mamba2.mixer2, shapes=mamba2.shapes, weights=mamba2.layer_weights,
                        state=mamba2.state_shapes, gpu_kernels=True),
}


def layer_kind(config) -> LayerKind:
    return LAYER_KINDS[getattr(config, "layer", "mamba1")]


class Mamba:
    """A Mamba language model (Mamba-1 or Mamba-2 layers): embedding, layers, final norm and LM head.

    `backbone` is the recurrent core on its own (vectors in, vectors out), for uses
    outside language modelling.
    """

    def __init__(self, config: MambaConfig, weights: MambaWeights, ops: Ops = REFERENCE_OPS, chunk_tokens: int = 16384,
                 state_dtype: torch.dtype = torch.float32):
        self.config = config
        self.weights = weights
        self.ops = ops
        self.layer = layer_kind(config)
        # The dtype the conv and ssm states are stored in; every update computes in float32
        # and rounds once on store (the reference ops promote a 16-bit state as they read it).
        self.state_dtype = state_dtype
        # Prefill runs long prompts in chunks of at most this many tokens across the batch
        # (chunk_tokens // B steps a row), so activation memory stays bounded whatever the
        # prompt. Large chunks pay: each chunk is one pass of every layer's kernels, and the
        # scan's parallelism over time grows with it (H200, bf16: a 100,000-token prompt on
        # 130m 314 ms in 4096-token chunks, 117 in 16384; 2.8b 1 x 16384 251 -> 239 ms).
        self.chunk_tokens = chunk_tokens

    @property
    def device(self) -> torch.device:
        return self.weights.embedding.device

    def new_state(self, batch: int) -> MambaState:
        return MambaState.zeros(self.config, batch, self.device, self.state_dtype)

    def backbone(self, h: torch.Tensor, state: MambaState, start=None, check: bool | None = None) -> torch.Tensor:
        """All layers and the final norm over T inputs: h (B, T, d) f32 -> (B, T, d) f32.

        check: raise NonFiniteError at the first layer whose output holds NaN or inf. Always
        on the reference ops (a reduction a layer, small beside the layer's products on the
        CPU); off in the GPU kernels' pass, where the caller checks the logits and, if they
        are not finite, runs `nonfinite_layer` to name the layer."""
        check = self.ops is REFERENCE_OPS if check is None else check
        h, o, eps = h.float(), None, self.config.norm_eps
        for i, lw in enumerate(self.weights.layers):
            # the norm comes out in the dtype in_proj reads (GPU path; the reference keeps f32)
            h, u = self.ops.add_norm(h, o, lw.norm_w, eps, lw.in_proj_w.dtype)
            o = self.layer.mixer(self.config, lw, u, state.conv[i], state.ssm[i], self.ops, start)
            if check and not torch.isfinite(o).all():
                raise NonFiniteError(
                    f"the model's output is not finite: layer {i} (backbone.layers.{i}) gives NaN or inf for this "
                    f"input, its weights overflow the arithmetic (storage {str(lw.in_proj_w.dtype).removeprefix('torch.')})")
        return self.ops.add_norm(h, o, self.weights.norm_f, eps, torch.float32)[1]

    def check_finite(self, logits: torch.Tensor, prompts) -> None:
        """NonFiniteError naming the first layer at fault if `logits` (of the prefill of
        `prompts` from a zero state) hold NaN or inf; one reduction and one read otherwise."""
        if not torch.isfinite(logits).all():
            raise NonFiniteError(self.nonfinite_culprit(prompts))

    def nonfinite_culprit(self, prompts) -> str:
        """Why the prefill of `prompts` (token id lists, or the rows of a (B, T) tensor) is not
        finite: each prompt's prefill again, with a check after every layer, names the first
        layer (or the final norm, or lm_head)."""
        try:
            for ids in prompts:
                x = torch.as_tensor(ids, dtype=torch.int64, device=self.device)[None]
                h = self.backbone(self.weights.embedding[x], self.new_state(1), check=True)  # raises at a layer
                if not torch.isfinite(h).all():
                    return "the model's output is not finite: the final norm (backbone.norm_f) gives NaN or inf for this input"
        except NonFiniteError as e:
            return str(e)
        return "the model's output is not finite: lm_head gives NaN or inf for this input"

    def prefill(
        self, input_ids: torch.Tensor, state: MambaState, start: torch.Tensor | None = None, last_only: bool = False
    ) -> torch.Tensor:
        """Logits for T tokens, continuing from `state` and updating it.

        input_ids (B, T) -> (B, T, V) f32, or (B, V) for the last token alone (last_only).
        start (B,) int32: row b is left-padded up to start[b] (and starts from a zero state).
        Long inputs run in chunks of `self.chunk_tokens` tokens, so memory stays bounded.
        """
        B, T = input_ids.shape
        chunk = max(1, self.chunk_tokens // B)  # steps a row
        outs = []
        for c0 in range(0, T, chunk):
            ids = input_ids[:, c0 : c0 + chunk]
            chunk_start = None if start is None else (start - c0).clamp(min=0).to(torch.int32)
            h = self.backbone(self.weights.embedding[ids], state, chunk_start)  # (B, Tc, d)
            if last_only:
                h = h[:, -1:] if c0 + chunk >= T else None
            if h is not None:
                outs.append(self.ops.linear(h, self.weights.lm_head))
        logits = torch.cat(outs, dim=1)
        return logits[:, -1] if last_only else logits

    def step(self, input_ids: torch.Tensor, state: MambaState) -> torch.Tensor:
        """One decode step: input_ids (B,) -> logits (B, V) f32; updates `state`."""
        return self.prefill(input_ids[:, None], state, last_only=True)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits of a whole sequence from an empty state: (B, T) -> (B, T, V) f32."""
        return self.prefill(input_ids, self.new_state(input_ids.shape[0]))
