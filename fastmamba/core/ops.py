"""The operations a layer's sequence pass is made of (`Ops`), so that one layer definition runs on
either engine: the pure-PyTorch `_ref` twins (the CPU engine and every test's oracle), or
cuBLAS products and the Triton kernels (the GPU engine), or the training kernels whose
backward runs in Triton (fastmamba.Backbone under autograd).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch
import torch.nn.functional as F

from fastmamba.core import fp8
from fastmamba.core.fp8 import Fp8Weight
from fastmamba.kernels.causal_conv1d import ConvTiles, causal_conv1d_ref
from fastmamba.kernels.conv_grad import ConvGradTiles
from fastmamba.kernels.gated_norm import gated_rmsnorm_ref
from fastmamba.kernels.paged_attention import PagedTiles
from fastmamba.kernels.products import linear_storage
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
    # a decode step's attention over the paged KV cache (kernels/paged_attention.py); None:
    # the attention sublayer's own torch ops, as for prefill
    paged_decode: Callable | None = None


REFERENCE_OPS = Ops(linear, causal_conv1d_ref, step_and_scan_ref, add_norm_ref)


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


def triton_ops(tiles: KernelTiles) -> Ops:
    """cuBLAS products and the Triton kernels (the GPU engine), launched with `tiles`."""
    from fastmamba.kernels.causal_conv1d import causal_conv1d
    from fastmamba.kernels.gated_norm import gated_rmsnorm
    from fastmamba.kernels.paged_attention import paged_decode
    from fastmamba.kernels.rmsnorm import add_norm
    from fastmamba.kernels.selective_scan import step_and_scan
    from fastmamba.kernels.ssd import ssd_scan

    return Ops(linear_storage, partial(causal_conv1d, tiles=tiles.conv), partial(step_and_scan, tiles=tiles.scan),
               add_norm, partial(ssd_scan, tiles=tiles.ssd), gated_rmsnorm, partial(paged_decode, tiles=tiles.paged))


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


