"""MambaConfig: the model's sizes, read from config.json: Mamba-1 and Mamba-2 in either format
(HF, original state-spaces), Falcon-Mamba, and the hybrids that put attention, MLPs and
experts beside Mamba-2 (Nemotron-H, Bamba, Granite-4.0-H, Falcon-H1) or Mamba-1 (Jamba;
their keys read in hybrid_config.py). Every field that changes the math is read, or refused by name
(config_fields.py reads and checks each value)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path

from fastmamba.core.config_fields import dt_limit, dt_rank, eos_id, eos_ids, get
from fastmamba.core.errors import CheckpointError
from fastmamba.core.hybrid_config import HYBRIDS
from fastmamba.core.quant_config import Fp8Scheme, fp8_scheme


@dataclass(frozen=True)
class MambaConfig:
    d_model: int
    n_layer: int
    vocab_size: int  # rows of the embedding, padding included
    d_state: int = 16
    d_conv: int = 4
    d_inner: int = 0  # 0 means expand * d_model
    dt_rank: int = 0  # 0 means ceil(d_model / 16)
    conv_bias: bool = True
    proj_bias: bool = False  # in_proj / out_proj bias
    norm_eps: float = 1e-5
    tie_embeddings: bool = True
    eos_token_id: int = 0
    # every id a reply stops at unless a request says otherwise: eos_token_id's list whole,
    # and generation_config.json's (an instruct model's end of turn); () means (eos_token_id,)
    stop_token_ids: tuple[int, ...] = ()
    # Falcon-Mamba: after x_proj, dt_r, B and C are each RMS-normalised over their last
    # dimension, with no weight, with this eps (Jamba: then times the weights of its
    # "mamba1_normed" layers); None: plain Mamba, no such norm.
    dbc_norm_eps: float | None = None
    # The layer: "mamba1" (selective scan), or "mamba2" (SSD: heads of head_dim channels
    # sharing n_groups groups of B and C, scanned in chunks of chunk_size; mamba2.py)
    layer: str = "mamba1"
    n_groups: int = 1
    head_dim: int = 64
    chunk_size: int = 256
    dt_limit: tuple[float, float] = (0.0, math.inf)
    norm_before_gate: bool = False
    ssm_norm: bool = True  # Mamba-2's gated RMSNorm (Falcon-H1 may leave it out: y * silu(z))
    # -- hybrids (core/families.py names their tensors) ------------------------------------
    # The sublayers in order, each a kind of the layer table (core/layers.py): "mamba1",
    # "mamba1_normed" (Jamba's: dt, B and C normed with weights), "mamba2", "attention", "mlp",
    # "moe" (experts, and a shared MLP where the family has one), or "mamba2+attention"
    # (Falcon-H1: both on one norm, summed).
    # Empty: a pure Mamba model, n_layer sublayers of `layer`.
    blocks: tuple[str, ...] = ()
    family: str = "mamba"  # the checkpoint's tensor names (core/families.py)
    attn_heads: int = 0
    kv_heads: int = 0
    attn_head_dim: int = 0
    attn_bias: bool = False  # q, k, v and o projections' biases
    attn_scale: float = 0.0  # the softmax's scale; 0: attn_head_dim ** -0.5
    rope_theta: float = 0.0  # 0: no positions in attention (NoPE)
    rotary_dim: int = 0  # the leading dims of a head that RoPE rotates (partial rotary)
    mlp_size: int = 0
    mlp_act: str = "silu"  # "silu" or "relu2" (squared ReLU)
    mlp_gated: bool = True  # act(gate(x)) * up(x), else act(up(x))
    mlp_bias: bool = False
    # A mixture of experts (the "moe" sublayers, core/moe.py): n_experts gated MLPs of
    # expert_size each (the MLP's activation), experts_per_token of them picked a token by the
    # router (below); beside the shared MLP of mlp_size where the family has one
    n_experts: int = 0
    experts_per_token: int = 0
    expert_size: int = 0
    # The router: "softmax" (Granite) the softmax of the top logits, renormalized;
    # "softmax_all" (Jamba) the top probabilities of a softmax over all experts, not
    # renormalized; "sigmoid" (Nemotron-H) sigmoid scores, a per-expert bias added for the
    # choice alone, the choice limited to the topk_groups best of expert_groups groups (a
    # group's score: its two best), the picked scores renormalized where norm_topk, then
    # scaled by routed_scaling
    router: str = "softmax"
    expert_groups: int = 1
    topk_groups: int = 1
    norm_topk: bool = True
    routed_scaling: float = 1.0
    shared_size: int = 0  # the shared MLP's width beside the experts; 0: mlp_size
    embedding_multiplier: float = 1.0  # the embedding's output scaled by this
    logits_multiplier: float = 1.0  # the logits scaled by this
    # The family's multipliers that scale a product's input or output (Granite's residual,
    # Falcon-H1's muP ones), by their config.json names: folded into the weights at load
    # (core/families.py), so that no kernel sees them.
    multipliers: tuple[tuple[str, float | tuple[float, ...]], ...] = ()
    # An FP8 checkpoint's scheme (its quantization_config, quant_config.py): how the float8
    # weights it stores are scaled. None: its weights are 16/32-bit.
    fp8: Fp8Scheme | None = None

    @property
    def n_heads(self) -> int:
        return self.d_inner // self.head_dim

    @property
    def kinds(self) -> tuple[str, ...]:
        """Each sublayer's kind, in order."""
        return self.blocks or (self.layer,) * self.n_layer

    @property
    def hybrid(self) -> bool:
        """Whether any sublayer is other than a Mamba layer (attention, MLP): KV caches and no
        fused Mamba decode kernels."""
        return any(k not in ("mamba1", "mamba2") for k in self.kinds)

    @property
    def n_recurrent(self) -> int:
        """The sublayers with a recurrent state (a Mamba mixer)."""
        return sum(k.startswith("mamba") for k in self.kinds)

    @property
    def n_attention(self) -> int:
        """The sublayers with a KV cache (attention)."""
        return sum(k.endswith("attention") for k in self.kinds)

    def multiplier(self, name: str, default=1.0):
        return dict(self.multipliers).get(name, default)

    def __post_init__(self):
        # Derived sizes are resolved here so every reader sees plain numbers.
        if self.d_inner == 0:
            object.__setattr__(self, "d_inner", 2 * self.d_model)
        if self.dt_rank == 0:
            object.__setattr__(self, "dt_rank", math.ceil(self.d_model / 16))

    @classmethod
    def from_dict(cls, raw: dict, source: str = "config.json") -> "MambaConfig":
        """Builds a config from an HF (`hidden_size`, ...) or original (`d_model`, ...) dict."""
        fp8 = fp8_scheme(raw["quantization_config"], source) if raw.get("quantization_config") is not None else None
        if "hidden_size" in raw:
            config = _from_hf(raw, source)
        elif "d_model" in raw:
            config = _from_original(raw, source)
        else:
            raise CheckpointError(
                f"{source}: neither 'hidden_size' (HF format) nor 'd_model' (original format) is present"
            )
        if config.layer == "mamba2" and not 1 <= config.chunk_size <= MAX_CHUNK_SIZE:
            raise CheckpointError(
                f"{source}: Mamba-2's chunk size (key 'chunk_size' / 'mamba_chunk_size') is {config.chunk_size}; it "
                f"must be 1 to {MAX_CHUNK_SIZE} (the public checkpoints' are 128 or 256): a prefill holds chunk x "
                "chunk scores a head"
            )
        config = config.with_stops(eos_ids(raw, source) if "eos_token_id" in raw else (), source, "eos_token_id")
        return config if fp8 is None else replace(config, fp8=fp8)

    def with_stops(self, ids: tuple[int, ...], source: str, key: str) -> "MambaConfig":
        """This config with `ids` among its default stops, each checked against the vocabulary."""
        stops = tuple(dict.fromkeys(self.default_stops + ids))
        for i in stops:
            if i >= self.vocab_size:
                raise CheckpointError(f"{source}: key '{key}' holds {i}, outside the vocabulary [0, {self.vocab_size})")
        return replace(self, stop_token_ids=stops)

    @property
    def default_stops(self) -> tuple[int, ...]:
        return self.stop_token_ids or (self.eos_token_id,)

    @classmethod
    def from_file(cls, path: Path) -> "MambaConfig":
        try:
            raw = json.loads(Path(path).read_text())
        except FileNotFoundError:
            raise CheckpointError(f"{path}: config.json not found") from None
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
            raise CheckpointError(f"{path}: not valid JSON ({type(e).__name__}: {e})") from None
        except OSError as e:  # a folder of that name, a symlink loop, no permission
            raise CheckpointError(f"{path}: cannot read config.json ({type(e).__name__}: {e.strerror or e})") from None
        if not isinstance(raw, dict):
            raise CheckpointError(f"{path}: expected a JSON object")
        return cls.from_dict(raw, str(path))

    def to_hf_dict(self) -> dict:
        """The HF `MambaConfig` (or `FalconMambaConfig`) keys for this config (used when
        writing a checkpoint)."""
        if self.layer != "mamba1":
            raise ValueError("to_hf_dict writes Mamba-1 configs only")
        falcon = {"mixer_rms_eps": self.dbc_norm_eps} if self.dbc_norm_eps is not None else {}
        return {
            "architectures": ["FalconMambaForCausalLM" if falcon else "MambaForCausalLM"],
            "model_type": "falcon_mamba" if falcon else "mamba",
            **falcon,
            "hidden_size": self.d_model,
            "num_hidden_layers": self.n_layer,
            "vocab_size": self.vocab_size,
            "state_size": self.d_state,
            "conv_kernel": self.d_conv,
            "expand": self.d_inner // self.d_model,
            "intermediate_size": self.d_inner,
            "time_step_rank": self.dt_rank,
            "use_conv_bias": self.conv_bias,
            "use_bias": self.proj_bias,
            "layer_norm_epsilon": self.norm_eps,
            "tie_word_embeddings": self.tie_embeddings,
            "residual_in_fp32": True,
            "eos_token_id": self.eos_token_id,
            "bos_token_id": self.eos_token_id,
            "pad_token_id": self.eos_token_id,
        }


# Mamba-2's largest chunk: a prefill's reference scan holds chunk x chunk scores a head
# (the Triton scan's chunk is its own tile, the same sum).
MAX_CHUNK_SIZE = 1024

_MODEL_TYPES = ("mamba", "falcon_mamba", "mamba2", "nemotron_h", "bamba", "granitemoehybrid", "falcon_h1", "jamba")


def _from_hf(raw: dict, source: str) -> MambaConfig:
    model_type = raw.get("model_type", "mamba")
    if model_type not in _MODEL_TYPES:
        raise CheckpointError(
            f"{source}: model_type is {model_type!r}; supported: 'mamba' (Mamba-1), 'falcon_mamba', 'mamba2', and the "
            "hybrids 'nemotron_h', 'bamba', 'granitemoehybrid', 'falcon_h1' and 'jamba' (Zamba2 is not)"
        )
    if model_type == "mamba2":
        return _mamba2_from_hf(raw, source)
    if model_type in HYBRIDS:
        return MambaConfig(**HYBRIDS[model_type](raw, source))
    falcon = model_type == "falcon_mamba"
    _silu_only(raw, source)
    d_model = get(raw, "hidden_size", int, source)
    expand = get(raw, "expand", int, source, 2)
    return MambaConfig(
        d_model=d_model,
        n_layer=get(raw, "num_hidden_layers", int, source),
        vocab_size=get(raw, "vocab_size", int, source),
        d_state=get(raw, "state_size", int, source, 16),
        d_conv=get(raw, "conv_kernel", int, source, 4),
        d_inner=get(raw, "intermediate_size", int, source, expand * d_model),
        dt_rank=dt_rank(raw.get("time_step_rank"), "time_step_rank", source),
        conv_bias=get(raw, "use_conv_bias", bool, source, True),
        proj_bias=get(raw, "use_bias", bool, source, False),
        norm_eps=get(raw, "layer_norm_epsilon", float, source, 1e-5),
        tie_embeddings=get(raw, "tie_word_embeddings", bool, source, True),
        eos_token_id=eos_id(raw, source),
        dbc_norm_eps=get(raw, "mixer_rms_eps", float, source, 1e-6) if falcon else None,
    )


def _mamba2(source: str, *, d_model: int, expand: int, head_dim: int, n_heads: int | None, n_groups: int,
            absent: frozenset = frozenset(), **fields) -> MambaConfig:
    """A Mamba-2 config, its head and group counts checked against each other. absent: the
    fields config.json does not set (their defaults), so that an error blames no key the
    file lacks without saying so."""

    def defaults(*names: str) -> str:
        unset = [n for n in names if n in absent]
        return f"; defaults, not in config.json: {', '.join(unset)}" if unset else ""

    d_inner = expand * d_model
    if d_inner % head_dim:
        raise CheckpointError(f"{source}: d_inner {d_inner} (expand x hidden size) is not a multiple of head_dim "
                              f"{head_dim}{defaults('head_dim')}")
    if n_heads is not None and n_heads != d_inner // head_dim:
        raise CheckpointError(f"{source}: key 'num_heads' is {n_heads}, but expand x hidden size / head_dim is "
                              f"{d_inner // head_dim}")
    if (d_inner // head_dim) % n_groups:
        raise CheckpointError(f"{source}: Mamba-2's n_groups {n_groups} must divide its {d_inner // head_dim} heads "
                              f"(d_inner {d_inner} / head_dim {head_dim}){defaults('n_groups', 'head_dim')}")
    return MambaConfig(d_model=d_model, d_inner=d_inner, head_dim=head_dim, n_groups=n_groups, layer="mamba2", **fields)


# Mamba-2's layer fields in either format: (field, transformers' key, the original format's
# ssm_cfg key, type, transformers' default, the original format's default). Defaults apply
# where a key is absent, as each library's own config class has them.
_MAMBA2_LAYER_KEYS = (
    ("expand", "expand", "expand", int, 2, 2),
    ("head_dim", "head_dim", "headdim", int, 64, 64),
    ("n_groups", "n_groups", "ngroups", int, 8, 1),
    ("d_state", "state_size", "d_state", int, 128, 128),
    ("d_conv", "conv_kernel", "d_conv", int, 4, 4),
    ("chunk_size", "chunk_size", "chunk_size", int, 256, 256),
    # (transformers' Mamba2 gates before its norm whatever config.json says: hub configs of
    # transformers 4.44 carry a "norm_before_gate": true that its model never read, Codestral's among them)
    ("norm_before_gate", None, "norm_before_gate", bool, False, False),
    ("conv_bias", "use_conv_bias", "conv_bias", bool, True, True),
    ("proj_bias", "use_bias", "bias", bool, False, False),
)


def _mamba2_layer(raw: dict, source: str, hf: bool) -> dict:
    """The layer fields of _MAMBA2_LAYER_KEYS from `raw` (config.json, or its ssm_cfg), and
    `absent`: those it does not set."""
    fields, absent = {}, set()
    for field, hf_key, key, kind, hf_default, default in _MAMBA2_LAYER_KEYS:
        name, fallback = (hf_key, hf_default) if hf else (key, default)
        fields[field] = fallback if name is None else get(raw, name, kind, source, fallback)  # (None: not read)
        if name is None or raw.get(name) is None:
            absent.add(field)
    return {**fields, "absent": frozenset(absent)}


def _silu_only(raw: dict, source: str) -> None:
    """The conv's activation (transformers' `hidden_act`): SiLU, the kernels' own."""
    if raw.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"{source}: key 'hidden_act' is {raw['hidden_act']!r}; only 'silu' is supported")


def _mamba2_from_hf(raw: dict, source: str) -> MambaConfig:
    _silu_only(raw, source)  # (`rms_norm`: transformers' Mamba2 reads it nowhere, nor does this)
    return _mamba2(
        source,
        d_model=get(raw, "hidden_size", int, source),
        n_heads=get(raw, "num_heads", int, source) if raw.get("num_heads") is not None else None,
        n_layer=get(raw, "num_hidden_layers", int, source),
        vocab_size=get(raw, "vocab_size", int, source),
        dt_limit=dt_limit(raw.get("time_step_limit"), "time_step_limit", source),
        norm_eps=get(raw, "layer_norm_epsilon", float, source, 1e-5),
        tie_embeddings=get(raw, "tie_word_embeddings", bool, source, False),
        eos_token_id=eos_id(raw, source),
        **_mamba2_layer(raw, source, hf=True),
    )


def _mamba2_from_original(raw: dict, ssm: dict, source: str, vocab_size: int) -> MambaConfig:
    sub = f"{source} (ssm_cfg)"
    if ssm.get("rmsnorm", True) is not True:
        raise CheckpointError(f"{sub}: key 'rmsnorm' is not true; only the gated RMSNorm of Mamba-2 is supported")
    if ssm.get("D_has_hdim", False) is not False:
        raise CheckpointError(f"{sub}: key 'D_has_hdim' is true; only a D per head is supported")
    if ssm.get("d_ssm") is not None:
        raise CheckpointError(f"{sub}: key 'd_ssm' is set; only an SSM over all of d_inner is supported")
    return _mamba2(
        source,
        d_model=get(raw, "d_model", int, source),
        n_heads=None,
        n_layer=get(raw, "n_layer", int, source),
        vocab_size=vocab_size,
        dt_limit=dt_limit(ssm.get("dt_limit"), "ssm_cfg.dt_limit", source),
        norm_eps=get(raw, "norm_epsilon", float, source, 1e-5),
        tie_embeddings=get(raw, "tie_embeddings", bool, source, True),
        eos_token_id=eos_id(raw, source),
        **_mamba2_layer(ssm, sub, hf=False),
    )


def _from_original(raw: dict, source: str) -> MambaConfig:
    ssm = raw.get("ssm_cfg") or {}
    if not isinstance(ssm, dict):
        raise CheckpointError(f"{source}: key 'ssm_cfg' must be an object")
    if ssm.get("layer", "Mamba1") not in ("Mamba1", "Mamba2"):
        raise CheckpointError(f"{source}: ssm_cfg.layer is {ssm['layer']!r}; Mamba1 and Mamba2 are supported")
    if raw.get("rms_norm", True) is not True:
        raise CheckpointError(f"{source}: key 'rms_norm' is false; only RMSNorm Mamba models are supported")
    # (mamba_ssm's own hybrids: an MLP after each mixer, attention at some layers)
    if raw.get("d_intermediate", 0) not in (0, None):
        raise CheckpointError(f"{source}: key 'd_intermediate' is {raw['d_intermediate']!r}; mamba_ssm's layers with "
                              "an MLP are not supported in this format")
    if raw.get("attn_layer_idx"):
        raise CheckpointError(f"{source}: key 'attn_layer_idx' is {raw['attn_layer_idx']!r}; mamba_ssm's attention "
                              "layers are not supported in this format")
    sub = f"{source} (ssm_cfg)"
    d_model = get(raw, "d_model", int, source)
    multiple = get(raw, "pad_vocab_size_multiple", int, source, 8)
    vocab = get(raw, "vocab_size", int, source)
    if ssm.get("layer") == "Mamba2":
        return _mamba2_from_original(raw, ssm, source, math.ceil(vocab / multiple) * multiple)
    expand = get(ssm, "expand", int, sub, 2)
    return MambaConfig(
        d_model=d_model,
        n_layer=get(raw, "n_layer", int, source),
        vocab_size=math.ceil(vocab / multiple) * multiple,
        d_state=get(ssm, "d_state", int, sub, 16),
        d_conv=get(ssm, "d_conv", int, sub, 4),
        d_inner=expand * d_model,
        dt_rank=dt_rank(ssm.get("dt_rank"), "ssm_cfg.dt_rank", source),
        conv_bias=get(ssm, "conv_bias", bool, sub, True),
        proj_bias=get(ssm, "bias", bool, sub, False),
        norm_eps=get(raw, "norm_epsilon", float, source, 1e-5),
        tie_embeddings=get(raw, "tie_embeddings", bool, source, True),
        eos_token_id=eos_id(raw, source),
    )
