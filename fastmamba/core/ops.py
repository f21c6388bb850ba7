"""The operations a layer's sequence pass is made of (`Ops`), so that one layer definition runs on
either engine: the pure-PyTorch `_ref` twins (the CPU engine and every test's oracle), or
cuBLAS products and the Triton kernels (the GPU engine), or the training kernels whose
backward runs in Triton (fastmamba.Backbone under autograd).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial, wraps
from typing import Callable

import torch
import torch.nn.functional as F

from fastmamba.core import fp8
from fastmamba.core.fp8 import FP8, Fp8Weight
from fastmamba.kernels.causal_conv1d import ConvTiles, causal_conv1d_ref
from fastmamba.kernels.conv_grad import ConvGradTiles
from fastmamba.kernels.fp8_gemm import fp8_linear
from fastmamba.kernels.gated_norm import gated_rmsnorm_ref
from fastmamba.kernels.mlp_activation import mlp_activation_ref
from fastmamba.kernels.moe import MoELaunch, moe_ffn_ref, route_ref
from fastmamba.kernels.paged_attention import PagedTiles
from fastmamba.kernels.products import linear_invariant, linear_storage
from fastmamba.kernels.rmsnorm import add_norm_ref
from fastmamba.kernels.scan_grad import TrainScanTiles
from fastmamba.kernels.selective_scan import ScanTiles, step_and_scan_ref
from fastmamba.kernels.ssd import SSDTiles, ssd_scan_ref


def linear(x: torch.Tensor, weight: torch.Tensor | Fp8Weight, bias: torch.Tensor | None = None,
           out_dtype=None) -> torch.Tensor:
    """x @ weight.T + bias with float32 accumulation whatever the weight's storage dtype (an
    Fp8Weight's scales applied to the sums: core/fp8.linear).
    out_dtype: kernels/products.linear_storage's output dtype; the reference keeps float32."""
    if isinstance(weight, Fp8Weight):
        return fp8.linear(x, weight, bias)
    return F.linear(x.float(), weight.float(), bias)


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
    # a decode step's attention over the paged KV cache, its rotation and store included
    # (kernels/paged_attention.decode_attention); None: the attention sublayer's own torch
    # ops, as for prefill
    decode_attention: Callable | None = None
    # a mixture of experts' routed MLPs (kernels/moe.py, moe_ffn_ref's signature): by default
    # the twin over the reference products (one product an expert with tokens, the host
    # reading the counts)
    moe: Callable = partial(moe_ffn_ref, linear=linear)
    # a router's logits to each token's experts and weights (kernels/moe.route_ref's signature)
    route: Callable = route_ref
    # an MLP's activation between its products (kernels/mlp_activation.py's signature): the
    # reference keeps float32, the kernel rounds once to the down product's operand dtype
    mlp_act: Callable = mlp_activation_ref
    fp8: bool = False  # whether `linear` takes Fp8Weights (and the rest an activation dtype of FP8)


REFERENCE_OPS = Ops(linear, causal_conv1d_ref, step_and_scan_ref, add_norm_ref, fp8=True)


def gpu_linear(x: torch.Tensor, weight: torch.Tensor | Fp8Weight, bias: torch.Tensor | None = None,
               out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The GPU's product: kernels/products.linear_storage, or for an Fp8Weight
    kernels/fp8_gemm.fp8_linear (cuBLASLt's FP8 GEMM, the activations quantized a token)."""
    if isinstance(weight, Fp8Weight):
        return fp8_linear(x, weight.data, weight.scale, bias, out_dtype)
    return linear_storage(x, weight, bias, out_dtype)


def gpu_linear_invariant(x: torch.Tensor, weight: torch.Tensor | Fp8Weight, bias: torch.Tensor | None = None,
                         out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """kernels/products.linear_invariant (a row's bits the same at any number of rows), an
    Fp8Weight's e4m3 values read by the same GEMM, bfloat16 activations, its scales on the sums."""
    if isinstance(weight, Fp8Weight):
        return linear_invariant(x, weight.data, bias, out_dtype, scale=weight.scale)
    return linear_invariant(x, weight, bias, out_dtype)


def _fp8_as_bfloat16(fn: Callable) -> Callable:
    """fn with a dtype argument of FP8 taken as bfloat16: a layer asks for the activations
    its next product reads in the weights' storage dtype, which for FP8 weights is the
    products' own business (fp8_linear quantizes a token at a time); bfloat16 keeps
    float32's range at half the bytes, as on the bfloat16 path."""

    @wraps(fn)
    def wrapped(*args, **kwargs):
        args = tuple(torch.bfloat16 if a is FP8 else a for a in args)
        kwargs = {k: torch.bfloat16 if v is FP8 else v for k, v in kwargs.items()}
        return fn(*args, **kwargs)

    return wrapped


@dataclass(frozen=True)
class KernelTiles:
    """The launch settings the GPU ops bind into their kernels (the chosen ones:
    engine/plan.py's KERNEL_TILES)."""

    conv: ConvTiles  # the prefill conv (kernels/causal_conv1d.py)
    scan: ScanTiles  # Mamba-1's step sizes and scan (kernels/selective_scan.py, kernels/step_size.py)
    ssd: SSDTiles  # Mamba-2's scan (kernels/ssd.py)
    conv_grad: ConvGradTiles  # the training conv (kernels/conv_grad.py)
    train_scan: TrainScanTiles  # the training scan (kernels/scan_grad.py)
    paged: PagedTiles  # decode attention over the paged KV cache (kernels/paged_attention.py)
    moe: MoELaunch  # a mixture of experts' grouped products (kernels/moe.py), by the launch's tokens


def triton_ops(tiles: KernelTiles) -> Ops:
    """cuBLAS products and the Triton kernels (the GPU engine), launched with `tiles`."""
    from fastmamba.kernels.causal_conv1d import causal_conv1d
    from fastmamba.kernels.gated_norm import gated_rmsnorm
    from fastmamba.kernels.mlp_activation import mlp_activation
    from fastmamba.kernels.moe import moe_ffn_triton, route_triton
    from fastmamba.kernels.paged_attention import decode_attention
    from fastmamba.kernels.rmsnorm import add_norm
    from fastmamba.kernels.selective_scan import step_and_scan
    from fastmamba.kernels.ssd import ssd_scan

    fp8_safe = _fp8_as_bfloat16
    return Ops(gpu_linear, fp8_safe(partial(causal_conv1d, tiles=tiles.conv)),
               fp8_safe(partial(step_and_scan, tiles=tiles.scan)), add_norm,
               fp8_safe(partial(ssd_scan, tiles=tiles.ssd)), fp8_safe(gated_rmsnorm),
               partial(decode_attention, tiles=tiles.paged), partial(moe_ffn_triton, tiles=tiles.moe),
               route=route_triton, mlp_act=fp8_safe(mlp_activation), fp8=True)


def training_ops(tiles: KernelTiles) -> Ops:
    """The GPU ops whose backward runs in Triton too (fastmamba.Backbone's sequence pass
    under autograd): the conv and the scan as autograd Functions (kernels/conv_grad.py,
    kernels/scan_grad.py), launched with `tiles`, the products and norms as torch ops, all
    in float32."""
    from fastmamba.kernels.conv_grad import causal_conv1d_train
    from fastmamba.kernels.rmsnorm import add_norm_train
    from fastmamba.kernels.scan_grad import step_and_scan_train

    return Ops(linear, partial(causal_conv1d_train, tiles=tiles.conv_grad),
               partial(step_and_scan_train, tiles=tiles.train_scan), add_norm_train)


