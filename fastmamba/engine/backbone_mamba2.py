"""fastmamba.Backbone's Mamba-2 layer (BackboneConfig(layer="mamba2")): its parameters, named
as transformers' Mamba2Mixer names them, its state's shapes, and the ops its sequence pass
and step run. The layer's math is the language model's own (core/mamba2.mixer2); backbone.py
holds the one Backbone class and dispatches to this module by the config's layer.

Which ops run the layer:
- on the CPU, the reference ops with the chunked SSD of kernels/ssd_grad.py, written in
  torch ops that autograd differentiates (the reference's in-place state update would not be);
- on CUDA without autograd (rollouts, evaluation), the language model's prefill kernels
  (kernels/ssd.py's chunked SSD and the conv take the resets);
- on CUDA under autograd, the training kernels: the conv's (kernels/conv_grad.py) and the
  SSD's (kernels/ssd_grad.ssd_scan_train_triton: the language model's chunked forward
  kernels, and a backward of its own), forward and backward in Triton; the products and
  norms as torch ops in float32;
- the step, the layer at one token: on the CPU the reference ops; on CUDA the GPU ops
  (kernels/ssd.py's step kernel), replayed as a CUDA graph (backbone_step.py).

State: conv (L, B, E + 2GN, K), the last K inputs of x, B and C; ssm (L, B, E, N), each
head's (P, N) state one after another (E = H x P: the memory layout of the language model's
(L, B, H, P, N)), so that the state is the (L, B, channels, ...) MambaState the Mamba-1
Backbone keeps and `reset(mask)` zeroes rows alike.
"""

from __future__ import annotations

import math
from dataclasses import replace
from functools import partial

import torch
from torch import nn

from fastmamba.core import mamba2
from fastmamba.core.mamba2 import Mamba2LayerWeights
from fastmamba.core.ops import REFERENCE_OPS, Ops
from fastmamba.kernels.ssd_grad import ssd_scan_train

# the reference ops with an SSD that autograd differentiates (kernels/ssd_grad.py)
CPU_OPS = replace(REFERENCE_OPS, ssd=ssd_scan_train)


def state_shapes(c) -> tuple[tuple[int, int], tuple[int, int]]:
    """One slot's conv state (E + 2GN, K) and ssm state (E, N) (the heads' (P, N) flattened)."""
    return (c.d_inner + 2 * c.n_groups * c.d_state, c.d_conv), (c.d_inner, c.d_state)


def tensor_shapes(c, i: int) -> dict[str, tuple[int, ...]]:
    """Layer i's tensors and their shapes (transformers' Mamba2Model names)."""
    return mamba2.shapes(c, f"layers.{i}.norm.weight", f"layers.{i}.mixer.")


class _GateNorm(nn.Module):
    def __init__(self, E: int, device):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(E, device=device))


class Mixer2(nn.Module):
    """The parameters of one Mamba-2 layer's mixer, named as transformers' Mamba2Mixer names
    them, with mamba_ssm's initialisation (its Mamba2 module's)."""

    def __init__(self, c, device, dtype, dt_min=1e-3, dt_max=0.1, dt_floor=1e-4, A_range=(1.0, 16.0)):
        super().__init__()
        d, E, N, G, H, K = c.d_model, c.d_inner, c.d_state, c.n_groups, c.n_heads, c.d_conv
        conv_dim = E + 2 * G * N
        self.in_proj = nn.Linear(d, 2 * E + 2 * G * N + H, bias=c.proj_bias, device=device)  # z, xBC, dt
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, K, groups=conv_dim, padding=K - 1, bias=c.conv_bias, device=device)
        # step sizes log-uniform in [dt_min, dt_max], dt_bias their softplus inverse; A uniform in A_range
        dt = torch.exp(torch.rand(H, device=device) * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min))
        dt = dt.clamp(min=dt_floor)
        self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))
        self.A_log = nn.Parameter(torch.log(torch.empty(H, device=device).uniform_(*A_range)))
        self.D = nn.Parameter(torch.ones(H, device=device))
        self.norm = _GateNorm(E, device)
        self.out_proj = nn.Linear(E, d, bias=c.proj_bias, device=device)
        with torch.no_grad():  # mamba_ssm's rescale of the residual branch's last product
            self.out_proj.weight /= math.sqrt(c.n_layer)
        for lin in (self.in_proj, self.out_proj):  # the large matrices in `dtype`
            lin.weight.data = lin.weight.data.to(dtype)

    def weights(self, norm_w: torch.Tensor) -> Mamba2LayerWeights:
        """The layer as mamba2.mixer2 reads it (views of the parameters; A from A_log)."""
        return Mamba2LayerWeights(
            norm_w=norm_w, in_proj_w=self.in_proj.weight, in_proj_b=self.in_proj.bias,
            conv_w=self.conv1d.weight[:, 0, :], conv_b=self.conv1d.bias, dt_bias=self.dt_bias,
            A=-torch.exp(self.A_log.float()), D=self.D, gate_norm_w=self.norm.weight,
            out_proj_w=self.out_proj.weight, out_proj_b=self.out_proj.bias,
        )

    def large_matrices(self) -> list:
        return [self.in_proj.weight, self.out_proj.weight]


def run(c, lw: Mamba2LayerWeights, u: torch.Tensor, conv: torch.Tensor, ssm: torch.Tensor, ops: Ops,
        resets=None) -> torch.Tensor:
    """The layer over u (B, T, d) -> (B, T, d) float32, updating conv (B, E + 2GN, K) and
    ssm (B, E, N) (through its (B, H, P, N) view) in place."""
    return mamba2.mixer2(c, lw, u, conv, ssm.unflatten(1, (c.n_heads, c.head_dim)), ops, resets=resets)


def gpu_ops(training: bool) -> Ops:
    """The ops of the sequence pass on CUDA (see the module's doc): the prefill kernels, or
    under autograd the training kernels (the conv's and the SSD's)."""
    from fastmamba.core.ops import training_ops, triton_ops
    from fastmamba.engine.plan import KERNEL_TILES, SSD_GRAD_TILES
    from fastmamba.kernels.ssd_grad import ssd_scan_train_triton

    if not training:
        return triton_ops(KERNEL_TILES)
    return replace(training_ops(KERNEL_TILES), ssd=partial(ssd_scan_train_triton, tiles=KERNEL_TILES.ssd,
                                                           grad_tiles=SSD_GRAD_TILES),
                   gated_norm=CPU_OPS.gated_norm)


def step_ops(device: torch.device, plan=None) -> Ops:
    """The ops of the step: on CUDA the GPU ops (kernels/ssd.py's step kernel: graph-safe)
    with the products a "layer-ops" plan names (None: cuBLAS's), elsewhere the CPU's."""
    from fastmamba.kernels._triton import HAVE_TRITON

    if device.type == "cuda" and HAVE_TRITON:
        from fastmamba.engine.decode_step import layer_ops
        from fastmamba.engine.plan import LAYER_OPS

        return layer_ops(plan or LAYER_OPS)
    return CPU_OPS
