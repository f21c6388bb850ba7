"""Model families: how a checkpoint names its tensors, and the multipliers it folds in. A family
is a row of names, not a model class: every family runs on the one model (model.py), its
sublayers of the layer table's kinds (layers.py).

A model is an embedding, then sublayers, each `h = h + op(rmsnorm(h) * norm)`, then a final
norm and the LM head. A pure Mamba model has one sublayer a layer (its mixer); Nemotron-H
too (a Mamba-2, an attention or an MLP sublayer); Bamba, Granite-4.0-H and Falcon-H1 have
two a layer (the mixer, then the MLP: Granite's with experts a mixture of experts and its
shared MLP), and Falcon-H1's mixer is attention and Mamba-2 side
by side on one norm. Jamba has two a layer too: a Mamba-1 mixer (its dt, B and C normed with
weights) or attention, then an MLP or a mixture of experts (no shared MLP).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fastmamba.core.config import MambaConfig
from fastmamba.core.errors import CheckpointError
from fastmamba.core.fp8 import Fp8Weight


@dataclass(frozen=True)
class Sublayer:
    kind: str  # the layer table's kind (layers.py)
    norm: str  # the pre-norm's weight
    prefixes: tuple[str, ...]  # where the kind's tensors are: "mamba2+attention": the Mamba's, then the attention's


@dataclass(frozen=True)
class Family:
    embedding: str
    norm_f: str
    layer: str  # a layer's prefix, "{i}" its index
    # (norm, prefixes) of each sublayer of a layer by its kind, suffixes of the layer's prefix;
    # a layer holds one sublayer, or the mixer and the MLP (two_per_layer)
    names: dict[str, tuple[str, tuple[str, ...]]]
    two_per_layer: bool = False
    # the MLP's tensors: (up, down) for act(up(x)); (gate, up, down) for act(gate(x)) * up(x);
    # (gate_up, down) where gate and up are one tensor, gate's rows first
    mlp: tuple[str, ...] = ("gate_proj", "up_proj", "down_proj")
    # a mixture of experts' tensors (core/moe.py), suffixes of its first prefix: (router, the
    # experts' stacked gate_up (or up), their stacked down); "{e}" in a name: one tensor an
    # expert, and then gate and up may be apart (router, gate, up, down); its second prefix, if
    # any, is its shared MLP's
    moe: tuple[str, ...] = ("router.layer", "input_linear", "output_linear")
    lm_head: str = "lm_head.weight"
    # the weighted RMSNorms of a Mamba-1 mixer's dt, B and C (the "mamba1_normed" kind: Jamba's),
    # suffixes of the mixer's prefix
    dbc_norms: tuple[str, ...] = ("dt_layernorm", "b_layernorm", "c_layernorm")


_MIXER_ONLY = {"mamba1": ("norm.weight", ("mixer.",)), "mamba2": ("norm.weight", ("mixer.",)),
               "attention": ("norm.weight", ("mixer.",)), "mlp": ("norm.weight", ("mixer.",))}
_MIXER_AND_MLP = {"mamba2": ("input_layernorm.weight", ("mamba.",)),
                  "attention": ("input_layernorm.weight", ("self_attn.",)),
                  "mamba2+attention": ("input_layernorm.weight", ("mamba.", "self_attn."))}

FAMILIES = {
    "mamba": Family("backbone.embeddings.weight", "backbone.norm_f.weight", "backbone.layers.{i}.", _MIXER_ONLY),
    "nemotron_h": Family("backbone.embeddings.weight", "backbone.norm_f.weight", "backbone.layers.{i}.",
                         {**_MIXER_ONLY, "moe": ("norm.weight", ("mixer.", "mixer.shared_experts."))},
                         mlp=("up_proj", "down_proj"), moe=("gate", "experts.{e}.up_proj", "experts.{e}.down_proj")),
    "bamba": Family("model.embed_tokens.weight", "model.final_layernorm.weight", "model.layers.{i}.",
                    {**_MIXER_AND_MLP, "mlp": ("pre_ff_layernorm.weight", ("feed_forward.",))}, two_per_layer=True),
    "granitemoehybrid": Family("model.embed_tokens.weight", "model.norm.weight", "model.layers.{i}.",
                               {**_MIXER_AND_MLP, "mlp": ("post_attention_layernorm.weight", ("shared_mlp.",)),
                                "moe": ("post_attention_layernorm.weight", ("block_sparse_moe.", "shared_mlp."))},
                               two_per_layer=True, mlp=("input_linear", "output_linear")),
    "jamba": Family("model.embed_tokens.weight", "model.final_layernorm.weight", "model.layers.{i}.",
                    {"mamba1_normed": ("input_layernorm.weight", ("mamba.",)),
                     "attention": ("input_layernorm.weight", ("self_attn.",)),
                     "mlp": ("pre_ff_layernorm.weight", ("feed_forward.",)),
                     "moe": ("pre_ff_layernorm.weight", ("feed_forward.",))},
                    two_per_layer=True, moe=("router", "experts.{e}.gate_proj", "experts.{e}.up_proj",
                                             "experts.{e}.down_proj")),
    "falcon_h1": Family("model.embed_tokens.weight", "model.final_layernorm.weight", "model.layers.{i}.",
                        {**_MIXER_AND_MLP, "mlp": ("pre_ff_layernorm.weight", ("feed_forward.",))}, two_per_layer=True),
}


def family(config: MambaConfig) -> Family:
    return FAMILIES[config.family]


def sublayers(config: MambaConfig) -> list[Sublayer]:
    """Every sublayer of the model, in order, with its tensors' names."""
    return [sublayer(config, k) for k in range(len(config.kinds))]


def sublayer(config: MambaConfig, k: int) -> Sublayer:
    """Sublayer k, with its tensors' names."""
    fam = family(config)
    kind = config.blocks[k] if config.blocks else config.layer
    layer = fam.layer.format(i=k // 2 if fam.two_per_layer else k)
    norm, prefixes = fam.names[kind]
    return Sublayer(kind, layer + norm, tuple(layer + p for p in prefixes))


def first_sublayer(config: MambaConfig, layer: int) -> int:
    """The index of layer `layer`'s first sublayer."""
    return 2 * layer if family(config).two_per_layer else layer


def fold_multipliers(config: MambaConfig, tensors: dict[str, torch.Tensor]) -> None:
    """Scales (float32, before the storage dtype's rounding; an FP8 checkpoint's matrices
    through their scales) the weights whose
    product's input or output a family multiplies by a constant, so that the model runs
    without them: Granite-4.0-H's residual multiplier (each sublayer's output), Falcon-H1's
    muP multipliers (in_proj's input and each section of its output, out_proj's output,
    attention's input, keys and output, the MLP's gate and output)."""
    m = config.multiplier

    def scale(name: str, by, rows: slice = slice(None), suffixes=("weight", "bias")) -> None:
        for suffix in suffixes:
            t = tensors.get(f"{name}.{suffix}")
            if t is not None and by != 1.0 and isinstance(t, Fp8Weight):  # an FP8 checkpoint's: through its scales
                try:
                    tensors[f"{name}.{suffix}"] = t.scale_rows(rows, by)
                    continue
                except ValueError:  # (rows that are not whole blocks: as float32 values, as cat_rows does)
                    t = t.dequantize()
            if t is not None and by != 1.0:
                t = t.float().clone()  # (a copy: the files' own tensors may be read-only maps)
                t[rows] *= by
                if not torch.isfinite(t[rows]).all():  # (each factor finite, their product past float32)
                    raise CheckpointError(f"config.json's multiplier {by:g} times tensor '{name}.{suffix}' "
                                          "overflows float32")
                tensors[f"{name}.{suffix}"] = t

    for sub in sublayers(config):
        if config.family == "granitemoehybrid" and sub.kind == "moe":  # (the experts' and the shared MLP's sum)
            scale(sub.prefixes[0] + family(config).moe[-1], m("residual_multiplier"))
            scale(sub.prefixes[1] + family(config).mlp[-1], m("residual_multiplier"))
        elif config.family == "granitemoehybrid":
            out = {"mamba2": "out_proj", "attention": "o_proj", "mlp": family(config).mlp[-1]}[sub.kind]
            scale(sub.prefixes[0] + out, m("residual_multiplier"))
        elif config.family == "falcon_h1" and sub.kind == "mamba2+attention":
            mamba, attn = sub.prefixes
            E, GN, H = config.d_inner, config.n_groups * config.d_state, config.n_heads
            scale(mamba + "in_proj", m("ssm_in_multiplier"), suffixes=("weight",))  # (the input's: not the bias's)
            sections = (E, E, GN, GN, H)  # z, x, B, C, dt
            at = 0
            for n, mult in zip(sections, m("ssm_multipliers")):
                scale(mamba + "in_proj", mult, slice(at, at + n))
                at += n
            scale(mamba + "out_proj", m("ssm_out_multiplier"))
            for proj in ("q_proj", "k_proj", "v_proj"):
                scale(attn + proj, m("attention_in_multiplier"), suffixes=("weight",))
            scale(attn + "k_proj", m("key_multiplier"))
            scale(attn + "o_proj", m("attention_out_multiplier"))
        elif config.family == "falcon_h1" and sub.kind == "mlp":
            gate_mult, down_mult = m("mlp_multipliers")
            scale(sub.prefixes[0] + "gate_proj", gate_mult)
            scale(sub.prefixes[0] + "down_proj", down_mult)
