"""The one table of sublayer kinds: what each kind is (how it runs, its tensors and their
shapes, its weights built from them, the recurrent state and the keys and values a slot
keeps for it, whether the Triton engine's fused decode kernels run it), and the memory a
slot's recurrent state takes, read from it. The loader, the shape checks, the state and
cache shapes and the engine read this table; a family (families.py) names the tensors."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from fastmamba.core import attention as attn
from fastmamba.core import mamba2
from fastmamba.core import mlp as mlp_
from fastmamba.core import moe as moe_
from fastmamba.core.families import Family, Sublayer
from fastmamba.core.mamba1 import mamba1_shapes, mamba1_weights, mixer


@dataclass
class Memory:
    """What a sublayer reads and updates across passes, for the pass's rows: its conv and ssm
    states (a Mamba mixer), its keys and values (attention: the cache, its attention
    sublayer's index, the rows' slots in the cache)."""

    conv: torch.Tensor | None = None  # (B, ...)
    ssm: torch.Tensor | None = None
    kv: object = None  # kv_cache.KVCache
    layer: int = 0
    rows: torch.Tensor | None = None  # (B,) int64
    blocks: int = 0  # the blocks a row's context spans at most after the pass (the table's columns to read)


@dataclass
class ParallelWeights:
    """Falcon-H1's mixer: Mamba-2 and attention side by side on one norm, their outputs summed."""

    norm_w: torch.Tensor
    mamba: mamba2.Mamba2LayerWeights
    attention: attn.AttentionWeights


@dataclass(frozen=True)
class LayerKind:
    run: Callable  # (config, weights, u (B, T, d), Memory, ops, start, resets) -> (B, T, d) f32
    shapes: Callable  # (config, Sublayer, Family) -> {name: shape}
    weights: Callable  # (config, Sublayer, Family, big, small) -> the sublayer's weights
    state: Callable | None  # config -> one slot's (conv, ssm) state shapes; None: no recurrent state
    kv: bool  # whether a slot keeps its keys and values
    gpu_kernels: bool  # whether the Triton engine's fused decode step runs it


def _no_resets(resets, kind: str) -> None:
    if resets is not None:
        raise ValueError(f"resets inside a sequence apply to Mamba layers, not to {kind} sublayers")


def _attention_run(c, lw, u, m: Memory, ops, start=None, resets=None):
    _no_resets(resets, "attention")
    return attn.attention(c, lw, u, m.kv, m.layer, m.rows, ops, start, m.blocks)


def _mlp_run(c, lw, u, m: Memory, ops, start=None, resets=None):
    return mlp_.mlp(c, lw, u, ops)


def _moe_run(c, lw, u, m: Memory, ops, start=None, resets=None):
    return moe_.moe(c, lw, u, ops)


def _moe_shapes(c, s: Sublayer, f: Family) -> dict:
    return moe_.shapes(c, s.norm, s.prefixes[0], s.prefixes[1] if len(s.prefixes) > 1 else None, f.moe, f.mlp)


def _moe_weights(c, s: Sublayer, f: Family, big, small) -> moe_.MoEWeights:
    return moe_.layer_weights(c, s.norm, s.prefixes[0], s.prefixes[1] if len(s.prefixes) > 1 else None, f.moe, f.mlp,
                              big, small)


def _parallel_run(c, lw: ParallelWeights, u, m: Memory, ops, start=None, resets=None):
    _no_resets(resets, "attention")
    return (mamba2.mixer2(c, lw.mamba, u, m.conv, m.ssm, ops, start)
            + attn.attention(c, lw.attention, u, m.kv, m.layer, m.rows, ops, start, m.blocks))


def _parallel_shapes(c, s: Sublayer, f: Family) -> dict:
    return {**mamba2.shapes(c, s.norm, s.prefixes[0]), **attn.shapes(c, s.norm, s.prefixes[1])}


def _parallel_weights(c, s: Sublayer, f: Family, big, small) -> ParallelWeights:
    return ParallelWeights(small(s.norm), mamba2.layer_weights(s.norm, s.prefixes[0], big, small),
                           attn.layer_weights(s.norm, s.prefixes[1], big, small))


def _mamba1_state(c):
    return (c.d_inner, c.d_conv), (c.d_inner, c.d_state)


def _mamba1_run(c, lw, u, m: Memory, ops, start=None, resets=None):
    return mixer(c, lw, u, m.conv, m.ssm, ops, start, resets)


LAYER_KINDS = {
    "mamba1": LayerKind(
        run=_mamba1_run, shapes=lambda c, s, f: mamba1_shapes(c, s.norm, s.prefixes[0]),
        weights=lambda c, s, f, big, small: mamba1_weights(s.norm, s.prefixes[0], big, small),
        state=_mamba1_state, kv=False, gpu_kernels=True),
    # the same mixer with weighted RMSNorms on dt, B and C (Jamba's; the family names them,
    # families.Family.dbc_norms): the fused decode kernels have no such weights; a Jamba model
    # (always a hybrid) decodes through its layers over the GPU ops
    "mamba1_normed": LayerKind(
        run=_mamba1_run, shapes=lambda c, s, f: mamba1_shapes(c, s.norm, s.prefixes[0], f.dbc_norms),
        weights=lambda c, s, f, big, small: mamba1_weights(s.norm, s.prefixes[0], big, small, f.dbc_norms),
        state=_mamba1_state, kv=False, gpu_kernels=False),
    "mamba2": LayerKind(
        run=lambda c, lw, u, m, ops, start=None, resets=None: mamba2.mixer2(c, lw, u, m.conv, m.ssm, ops, start,
                                                                           resets),
        shapes=lambda c, s, f: mamba2.shapes(c, s.norm, s.prefixes[0]),
        weights=lambda c, s, f, big, small: mamba2.layer_weights(s.norm, s.prefixes[0], big, small),
        state=mamba2.state_shapes, kv=False, gpu_kernels=True),
    "attention": LayerKind(
        run=_attention_run, shapes=lambda c, s, f: attn.shapes(c, s.norm, s.prefixes[0]),
        weights=lambda c, s, f, big, small: attn.layer_weights(s.norm, s.prefixes[0], big, small),
        state=None, kv=True, gpu_kernels=False),
    "mlp": LayerKind(
        run=_mlp_run, shapes=lambda c, s, f: mlp_.shapes(c, s.norm, s.prefixes[0], f.mlp),
        weights=lambda c, s, f, big, small: mlp_.layer_weights(s.norm, s.prefixes[0], f.mlp, big, small),
        state=None, kv=False, gpu_kernels=False),
    # routed experts and a shared MLP (core/moe.py); on the GPU engine the grouped MoE kernel
    # (kernels/moe.py: its grouping on the device, no count on the host) in the CUDA graphs
    "moe": LayerKind(run=_moe_run, shapes=_moe_shapes, weights=_moe_weights, state=None, kv=False, gpu_kernels=False),
    "mamba2+attention": LayerKind(
        run=_parallel_run, shapes=_parallel_shapes, weights=_parallel_weights, state=mamba2.state_shapes, kv=True,
        gpu_kernels=False),
}


def layer_kind(config) -> LayerKind:
    """The kind of a pure Mamba model's layers (config.layer), whose state every recurrent
    sublayer of the model has (a hybrid's Mamba layers are all of one kind)."""
    return LAYER_KINDS[getattr(config, "layer", "mamba1")]


def kinds(config) -> list[LayerKind]:
    """Each sublayer's kind, in order."""
    return [LAYER_KINDS[k] for k in getattr(config, "kinds", None) or (getattr(config, "layer", "mamba1"),) * config.n_layer]


def off_gpu_engine(config) -> list[str]:
    """The names of the model's sublayer kinds the GPU engine cannot run; empty where it runs
    them all. Every kind runs over the GPU ops, so a hybrid's decode (its layers over them:
    plan.LAYER_OPS) takes any; a pure Mamba model decodes through the fused decode kernels,
    which its layer kind must have."""
    return [] if config.hybrid or layer_kind(config).gpu_kernels else [config.layer]


def state_bytes(config, dtype_bytes: int) -> int:
    """The bytes one slot's recurrent state takes (every Mamba sublayer's conv and ssm state)
    when stored in a dtype of `dtype_bytes` bytes an element: the one formula for every model,
    read by the server's slot count and the prefix cache's sizing. (Attention's keys and
    values grow with the context: kv_cache.py.)"""
    conv, ssm = layer_kind(config).state(config)
    return _n_recurrent(config) * (_numel(conv) + _numel(ssm)) * dtype_bytes


def _n_recurrent(config) -> int:
    return sum(k.state is not None for k in kinds(config))


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
