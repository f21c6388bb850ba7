"""The decode step the plan names (plan.py), for one batch size: the one-row kernels
(kernels/decode_step.py, kernels/decode_step_mamba2.py, a hybrid's
kernels/decode_step_hybrid.py), the products step (kernels/decode_gemm.py), or the model's
own layers at one token over the GPU ops ("layer-ops"). Each is `step(tokens, state) -> logits`, captured in CUDA graphs by
cuda_graphs.py."""

from __future__ import annotations

from dataclasses import replace
from functools import partial

import torch

from fastmamba.core.model import Mamba
from fastmamba.core.ops import Ops, gpu_linear_invariant, triton_ops
from fastmamba.engine.plan import KERNEL_TILES, one_row_blocks, plan_for
from fastmamba.kernels.decode_gemm import GemmDecodeStep
from fastmamba.kernels.decode_step import DecodeStep
from fastmamba.kernels.decode_step_hybrid import HybridDecodeStep
from fastmamba.kernels.decode_step_mamba2 import Mamba2DecodeStep
from fastmamba.kernels.moe import moe_ffn_triton


def make_decode_step(model, batch: int, deterministic: bool = False, plan=None):
    """The decode step for this batch size as `plan` says (default: plan.plan_for, the table
    of which step and products run where). A one-row plan without launch settings takes
    the table's for the model's shapes (plan.one_row_blocks)."""
    c, dtype = model.config, model.weights.dtype  # (float8_e4m3fn for FP8 weights: their own rows)
    plan = plan or plan_for(c, dtype, batch, deterministic)
    if plan.step == "layer-ops":
        return OpsDecodeStep(model, plan)
    if plan.step == "products":
        return GemmDecodeStep(model, batch, plan)
    if plan.blocks is None:
        plan = replace(plan, blocks=one_row_blocks(c.d_model, c.d_inner, c.vocab_size, dtype, c.layer))
    if c.hybrid:
        return HybridDecodeStep(model, batch, plan, KERNEL_TILES.paged)
    if c.layer == "mamba2":
        return Mamba2DecodeStep(model, batch, plan)
    return DecodeStep(model, batch, plan)


def layer_ops(plan) -> Ops:
    """The GPU ops of a "layer-ops" plan: cuBLAS's products where it names them, else
    invariant_gemm's and one set of the experts' tiles, so that a row's bits do not follow
    the batch (the language model's step here, a Mamba-2 Backbone's in backbone_ops)."""
    ops = triton_ops(KERNEL_TILES)
    if not plan.cublas:
        ops = replace(ops, linear=gpu_linear_invariant, moe=partial(moe_ffn_triton, tiles=KERNEL_TILES.moe.few))
    return ops


class OpsDecodeStep:
    """The decode step as the model's own layers at one token over its GPU ops (the plan's
    "layer-ops": Mamba-2's layer, kernels/ssd.py's step kernel for the scan), captured in
    CUDA graphs like the other steps. A plan without cuBLAS products runs them through
    invariant_gemm, so that a row's logits do not depend on the batch size."""

    def __init__(self, model, plan):
        self.plan = plan
        # (whatever ops the model was built with: this is the GPU's step)
        self.model = Mamba(model.config, model.weights, layer_ops(plan), model.chunk_tokens, model.state_dtype)

    def __call__(self, tokens: torch.Tensor, state, argmax: bool = False) -> torch.Tensor:
        """tokens (B,) -> logits (B, V) f32; updates `state`."""
        assert not argmax, "the layer-ops step has no fused argmax"
        return self.model.step(tokens, state)
