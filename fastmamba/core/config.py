"""MambaConfig: the model's sizes, read from config.json: Mamba-1 and Mamba-2 in either format
(HF, original state-spaces), Falcon-Mamba, and the hybrids that put attention and MLPs
beside Mamba-2 (Nemotron-H, Bamba, Granite-4.0-H, Falcon-H1). Every field that changes the
math is read, or refused by name."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from fastmamba.core.errors import CheckpointError


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
    # Falcon-Mamba: after x_proj, dt_r, B and C are each RMS-normalised over their last
    # dimension, with no weight, with this eps; None: plain Mamba, no such norm.
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
    # "mamba2", "attention", "mlp", or "mamba2+attention" (Falcon-H1: both on one norm, summed).
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
    embedding_multiplier: float = 1.0  # the embedding's output scaled by this
    logits_multiplier: float = 1.0  # the logits scaled by this
    # The family's multipliers that scale a product's input or output (Granite's residual,
    # Falcon-H1's muP ones), by their config.json names: folded into the weights at load
    # (core/families.py), so that no kernel sees them.
    multipliers: tuple[tuple[str, float | tuple[float, ...]], ...] = ()

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
        if raw.get("quantization_config") is not None:
            q = raw["quantization_config"]
            method = q.get("quant_method", "quantized") if isinstance(q, dict) else "quantized"
            raise CheckpointError(
                f"{source}: key 'quantization_config' describes {method} weights, which are not supported yet; "
                "load a float32, bfloat16 or float16 checkpoint"
            )
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
        if config.eos_token_id >= config.vocab_size:
            raise CheckpointError(
                f"{source}: key 'eos_token_id' is {config.eos_token_id}, outside the vocabulary [0, {config.vocab_size})"
            )
        return config

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


def _get(raw: dict, key: str, kind, source: str, default=None):
    """One config value, type-checked; a missing required key or a wrong type names the key."""
    if key not in raw or raw[key] is None:
        if default is None:
            raise CheckpointError(f"{source}: missing required key '{key}'")
        return default
    value = raw[key]
    if kind is int:
        ok = isinstance(value, int) and not isinstance(value, bool) and value > 0
    elif kind is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < math.inf
    else:
        ok = isinstance(value, kind)
    if not ok:
        expected = {int: "a positive integer", float: "a positive finite number", bool: "true or false"}
        raise CheckpointError(f"{source}: key '{key}' must be {expected.get(kind, kind.__name__)}, got {value!r}")
    return value


def _dt_rank(value, key: str, source: str) -> int:
    if value in (None, "auto"):
        return 0
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    raise CheckpointError(f"{source}: key '{key}' must be \"auto\" or a positive integer, got {value!r}")


# Mamba-2's largest chunk: a prefill's reference scan holds chunk x chunk scores a head
# (the Triton scan's chunk is its own tile, the same sum).
MAX_CHUNK_SIZE = 1024

_MODEL_TYPES = ("mamba", "falcon_mamba", "mamba2", "nemotron_h", "bamba", "granitemoehybrid", "falcon_h1")


def _from_hf(raw: dict, source: str) -> MambaConfig:
    model_type = raw.get("model_type", "mamba")
    if model_type not in _MODEL_TYPES:
        raise CheckpointError(
            f"{source}: model_type is {model_type!r}; supported: 'mamba' (Mamba-1), 'falcon_mamba', 'mamba2', and the "
            "hybrids 'nemotron_h', 'bamba', 'granitemoehybrid' (dense) and 'falcon_h1' (Jamba and Zamba2 are not)"
        )
    if model_type == "mamba2":
        return _mamba2_from_hf(raw, source)
    if model_type in _HYBRIDS:
        return _HYBRIDS[model_type](raw, source)
    falcon = model_type == "falcon_mamba"
    d_model = _get(raw, "hidden_size", int, source)
    expand = _get(raw, "expand", int, source, 2)
    return MambaConfig(
        d_model=d_model,
        n_layer=_get(raw, "num_hidden_layers", int, source),
        vocab_size=_get(raw, "vocab_size", int, source),
        d_state=_get(raw, "state_size", int, source, 16),
        d_conv=_get(raw, "conv_kernel", int, source, 4),
        d_inner=_get(raw, "intermediate_size", int, source, expand * d_model),
        dt_rank=_dt_rank(raw.get("time_step_rank"), "time_step_rank", source),
        conv_bias=_get(raw, "use_conv_bias", bool, source, True),
        proj_bias=_get(raw, "use_bias", bool, source, False),
        norm_eps=_get(raw, "layer_norm_epsilon", float, source, 1e-5),
        tie_embeddings=_get(raw, "tie_word_embeddings", bool, source, True),
        eos_token_id=_eos(raw, source),
        dbc_norm_eps=_get(raw, "mixer_rms_eps", float, source, 1e-6) if falcon else None,
    )


def _dt_limit(value, key: str, source: str) -> tuple[float, float]:
    """A [low, high] pair of step-size bounds (JSON may spell infinity `Infinity`)."""
    if value is None:
        return (0.0, math.inf)
    if isinstance(value, (list, tuple)):  # (transformers writes infinity as {"__float__": "Infinity"})
        value = [_json_float(v) for v in value]
    ok = (isinstance(value, (list, tuple)) and len(value) == 2
          and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)
          and 0 <= value[0] < value[1])
    if not ok:
        raise CheckpointError(f"{source}: key '{key}' must be [low, high] with 0 <= low < high, got {value!r}")
    return (float(value[0]), float(value[1]))


def _json_float(v):
    if isinstance(v, dict) and set(v) == {"__float__"} and isinstance(v["__float__"], str):
        try:
            return float(v["__float__"])
        except ValueError:
            return v
    return v


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
    ("norm_before_gate", "norm_before_gate", "norm_before_gate", bool, False, False),
    ("conv_bias", "use_conv_bias", "conv_bias", bool, True, True),
    ("proj_bias", "use_bias", "bias", bool, False, False),
)


def _mamba2_layer(raw: dict, source: str, hf: bool) -> dict:
    """The layer fields of _MAMBA2_LAYER_KEYS from `raw` (config.json, or its ssm_cfg), and
    `absent`: those it does not set."""
    fields = {field: _get(raw, hf_key if hf else key, kind, source, hf_default if hf else default)
              for field, hf_key, key, kind, hf_default, default in _MAMBA2_LAYER_KEYS}
    absent = frozenset(field for field, hf_key, key, *_ in _MAMBA2_LAYER_KEYS if raw.get(hf_key if hf else key) is None)
    return {**fields, "absent": absent}


def _mamba2_from_hf(raw: dict, source: str) -> MambaConfig:
    if raw.get("rms_norm", True) is not True:
        raise CheckpointError(f"{source}: key 'rms_norm' is not true; only the gated RMSNorm of Mamba-2 is supported")
    return _mamba2(
        source,
        d_model=_get(raw, "hidden_size", int, source),
        n_heads=_get(raw, "num_heads", int, source) if raw.get("num_heads") is not None else None,
        n_layer=_get(raw, "num_hidden_layers", int, source),
        vocab_size=_get(raw, "vocab_size", int, source),
        dt_limit=_dt_limit(raw.get("time_step_limit"), "time_step_limit", source),
        norm_eps=_get(raw, "layer_norm_epsilon", float, source, 1e-5),
        tie_embeddings=_get(raw, "tie_word_embeddings", bool, source, False),
        eos_token_id=_eos(raw, source),
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
        d_model=_get(raw, "d_model", int, source),
        n_heads=None,
        n_layer=_get(raw, "n_layer", int, source),
        vocab_size=vocab_size,
        dt_limit=_dt_limit(ssm.get("dt_limit"), "ssm_cfg.dt_limit", source),
        norm_eps=_get(raw, "norm_epsilon", float, source, 1e-5),
        tie_embeddings=_get(raw, "tie_embeddings", bool, source, True),
        eos_token_id=_eos(raw, source),
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
    sub = f"{source} (ssm_cfg)"
    d_model = _get(raw, "d_model", int, source)
    multiple = _get(raw, "pad_vocab_size_multiple", int, source, 8)
    vocab = _get(raw, "vocab_size", int, source)
    if ssm.get("layer") == "Mamba2":
        return _mamba2_from_original(raw, ssm, source, math.ceil(vocab / multiple) * multiple)
    expand = _get(ssm, "expand", int, sub, 2)
    return MambaConfig(
        d_model=d_model,
        n_layer=_get(raw, "n_layer", int, source),
        vocab_size=math.ceil(vocab / multiple) * multiple,
        d_state=_get(ssm, "d_state", int, sub, 16),
        d_conv=_get(ssm, "d_conv", int, sub, 4),
        d_inner=expand * d_model,
        dt_rank=_dt_rank(ssm.get("dt_rank"), "ssm_cfg.dt_rank", source),
        conv_bias=_get(ssm, "conv_bias", bool, sub, True),
        proj_bias=_get(ssm, "bias", bool, sub, False),
        norm_eps=_get(raw, "norm_epsilon", float, source, 1e-5),
        tie_embeddings=_get(raw, "tie_embeddings", bool, source, True),
        eos_token_id=_eos(raw, source),
    )


def _eos(raw: dict, source: str) -> int:
    eos = raw.get("eos_token_id", 0)
    if isinstance(eos, list) and eos:
        eos = eos[0]
    if not isinstance(eos, int) or isinstance(eos, bool) or eos < 0:
        raise CheckpointError(f"{source}: key 'eos_token_id' must be a non-negative integer, got {eos!r}")
    return eos


# -- hybrids ------------------------------------------------------------------------------------


def _one_of(raw: dict, source: str, keys: tuple[str, ...], kind, default=None):
    """The value of whichever of `keys` (a key and its other names, as hub configs and
    transformers 5 spell it) config.json holds; two of them that disagree name both."""
    present = [k for k in keys if raw.get(k) is not None]
    values = {json.dumps(raw[k], sort_keys=True) for k in present}
    if len(values) > 1:
        raise CheckpointError(f"{source}: keys {' and '.join(repr(k) for k in present)} disagree "
                              f"({', '.join(repr(raw[k]) for k in present)})")
    return _get(raw, present[0], kind, source, default) if present else _get(raw, keys[0], kind, source, default)


def _refuse_unless(raw: dict, source: str, key: str, allowed, why: str) -> None:
    if key in raw and raw[key] not in allowed:
        raise CheckpointError(f"{source}: key '{key}' is {raw[key]!r}; {why}")


def _attention_fields(raw: dict, source: str, d_model: int, head_dim_keys=("head_dim",), rope: bool = True) -> dict:
    heads = _get(raw, "num_attention_heads", int, source)
    kv = _get(raw, "num_key_value_heads", int, source, heads)
    if heads % kv:
        raise CheckpointError(f"{source}: key 'num_key_value_heads' ({kv}) must divide 'num_attention_heads' ({heads})")
    head_dim = _one_of(raw, source, head_dim_keys, int, d_model // heads)
    if raw.get("sliding_window") is not None:
        raise CheckpointError(f"{source}: key 'sliding_window' is {raw['sliding_window']!r}; only full attention is "
                              "supported")
    theta, rotary = _rope(raw, source, head_dim) if rope else (0.0, 0)
    return dict(attn_heads=heads, kv_heads=kv, attn_head_dim=head_dim, attn_bias=_get(raw, "attention_bias", bool, source, False),
                rope_theta=theta, rotary_dim=rotary)


def _rope(raw: dict, source: str, head_dim: int) -> tuple[float, int]:
    """RoPE's base and rotated dims, from transformers 5's `rope_parameters` or the older
    top-level `rope_theta`, `partial_rotary_factor` and `rope_scaling`; any RoPE but the
    default one is refused by name."""
    params = raw.get("rope_parameters")
    if params is not None and not isinstance(params, dict):
        raise CheckpointError(f"{source}: key 'rope_parameters' must be an object, got {params!r}")
    params = dict(params or {})
    scaling = raw.get("rope_scaling")
    if isinstance(scaling, dict):
        params = {**scaling, **params}
    elif scaling is not None:
        raise CheckpointError(f"{source}: key 'rope_scaling' must be an object or null, got {scaling!r}")
    kind = params.get("rope_type", params.get("type", "default"))
    if kind != "default":
        raise CheckpointError(f"{source}: RoPE of type {kind!r} (rope_parameters / rope_scaling) is not supported; "
                              "only the default RoPE is")
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    factor = params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    theta = _get({"rope_theta": theta}, "rope_theta", float, source)
    factor = _get({"partial_rotary_factor": factor}, "partial_rotary_factor", float, source)
    rotary = int(head_dim * factor)
    if not 0 < factor <= 1 or rotary % 2:
        raise CheckpointError(f"{source}: key 'partial_rotary_factor' ({factor}) must be in (0, 1] and leave an even "
                              f"number of rotated dims of head_dim {head_dim}")
    return float(theta), rotary


def _hybrid_mamba2(source: str, *, d_model: int, d_inner: int, n_heads: int, n_groups: int, **fields) -> dict:
    """A hybrid's Mamba-2 fields, its sizes checked against each other."""
    if d_inner % n_heads:
        raise CheckpointError(f"{source}: the Mamba layers' width {d_inner} is not a multiple of their {n_heads} heads")
    if n_heads % n_groups:
        raise CheckpointError(f"{source}: the Mamba layers' {n_groups} groups must divide their {n_heads} heads")
    return dict(layer="mamba2", d_model=d_model, d_inner=d_inner, head_dim=d_inner // n_heads, n_groups=n_groups,
                **fields)


def _vocab_and_head(raw: dict, source: str) -> dict:
    return dict(vocab_size=_get(raw, "vocab_size", int, source),
                tie_embeddings=_get(raw, "tie_word_embeddings", bool, source, False), eos_token_id=_eos(raw, source))


_NEMOTRON_BLOCKS = {"M": "mamba2", "*": "attention", "-": "mlp", "E": "moe"}
_NEMOTRON_TYPES = {"mamba": "mamba2", "linear_attention": "mamba2", "attention": "attention",
                   "full_attention": "attention", "mlp": "mlp", "moe": "moe"}


def _nemotron_h(raw: dict, source: str) -> MambaConfig:
    """Nemotron-H (and Nemotron Nano v2): one sublayer a layer, "M" Mamba-2, "*" attention (no
    positions), "-" an MLP of squared ReLU; `hybrid_override_pattern` (hub) or
    `layers_block_type` (transformers 5)."""
    pattern, types = raw.get("hybrid_override_pattern"), raw.get("layers_block_type")
    if types is not None:
        if not isinstance(types, list) or not all(t in _NEMOTRON_TYPES for t in types):
            raise CheckpointError(f"{source}: key 'layers_block_type' must be a list of {sorted(_NEMOTRON_TYPES)}, "
                                  f"got {types!r}")
        blocks = [_NEMOTRON_TYPES[t] for t in types]
        if pattern is not None and pattern != "".join({v: k for k, v in _NEMOTRON_BLOCKS.items()}[b] for b in blocks):
            raise CheckpointError(f"{source}: keys 'hybrid_override_pattern' and 'layers_block_type' disagree")
    elif isinstance(pattern, str) and pattern and set(pattern) <= set(_NEMOTRON_BLOCKS):
        blocks = [_NEMOTRON_BLOCKS[ch] for ch in pattern]
    else:
        raise CheckpointError(f"{source}: key 'hybrid_override_pattern' must be a string of M, *, - and E "
                              f"(or 'layers_block_type' a list), got {pattern!r}")
    if "moe" in blocks:
        raise CheckpointError(f"{source}: the layer pattern holds mixture-of-experts layers ('E' / 'moe'), which are "
                              "not supported yet")
    layers = raw.get("num_hidden_layers")
    if layers is not None and layers != len(blocks):
        raise CheckpointError(f"{source}: key 'num_hidden_layers' is {layers}, but the layer pattern has {len(blocks)}")
    if raw.get("num_nextn_predict_layers", 0) not in (0, None):
        raise CheckpointError(f"{source}: key 'num_nextn_predict_layers' is {raw['num_nextn_predict_layers']!r}; "
                              "multi-token prediction layers are not supported")
    _refuse_unless(raw, source, "mamba_hidden_act", ("silu",), "the Mamba layers' activation must be silu")
    _refuse_unless(raw, source, "mlp_hidden_act", ("relu2", "silu"), "the MLP's activation must be relu2 or silu")
    d_model = _get(raw, "hidden_size", int, source)
    heads = _get(raw, "mamba_num_heads", int, source, 128)
    head_dim = _get(raw, "mamba_head_dim", int, source, 64)
    in_out_bias = _one_of(raw, source, ("use_bias", "mamba_proj_bias"), bool, False)
    return MambaConfig(
        n_layer=len(blocks), blocks=tuple(blocks), family="nemotron_h",
        **_hybrid_mamba2(
            source, d_model=d_model, d_inner=heads * head_dim, n_heads=heads,
            n_groups=_one_of(raw, source, ("n_groups", "mamba_n_groups"), int, 8),
            d_state=_get(raw, "ssm_state_size", int, source, 128),
            d_conv=_one_of(raw, source, ("conv_kernel", "mamba_d_conv"), int, 4),
            chunk_size=_one_of(raw, source, ("chunk_size", "mamba_chunk_size"), int, 128),
            conv_bias=_one_of(raw, source, ("use_conv_bias", "mamba_conv_bias"), bool, True),
            proj_bias=in_out_bias,
            dt_limit=_dt_limit(raw.get("time_step_limit", raw.get("mamba_dt_limit")), "time_step_limit", source),
        ),
        norm_eps=_get(raw, "layer_norm_epsilon", float, source, 1e-5),
        **_attention_fields(raw, source, d_model, ("head_dim", "attention_head_dim"), rope=False),
        mlp_size=_get(raw, "intermediate_size", int, source), mlp_act=raw.get("mlp_hidden_act", "relu2"),
        mlp_gated=False, mlp_bias=_get(raw, "mlp_bias", bool, source, False),
        **_vocab_and_head(raw, source),
    )


def _mamba_fields_hf(raw: dict, source: str, d_model: int, d_inner: int) -> dict:
    """The `mamba_*` keys that Bamba, Granite-4.0-H and Falcon-H1 share."""
    heads = _get(raw, "mamba_n_heads", int, source, 128)
    head = raw.get("mamba_d_head", "auto")
    if head not in (None, "auto") and head * heads != d_inner:
        raise CheckpointError(f"{source}: key 'mamba_d_head' ({head}) x 'mamba_n_heads' ({heads}) must be the Mamba "
                              f"layers' width {d_inner}")
    return _hybrid_mamba2(
        source, d_model=d_model, d_inner=d_inner, n_heads=heads,
        n_groups=_get(raw, "mamba_n_groups", int, source, 1), d_state=_get(raw, "mamba_d_state", int, source, 256),
        d_conv=_get(raw, "mamba_d_conv", int, source, 4), chunk_size=_get(raw, "mamba_chunk_size", int, source, 256),
        conv_bias=_get(raw, "mamba_conv_bias", bool, source, True), proj_bias=_get(raw, "mamba_proj_bias", bool, source, False),
        dt_limit=_dt_limit(raw.get("time_step_limit"), "time_step_limit", source),
    )


def _expanded(raw: dict, source: str, d_model: int) -> int:
    return _get(raw, "mamba_expand", int, source, 2) * d_model


def _bamba(raw: dict, source: str) -> MambaConfig:
    """Bamba: each layer a Mamba-2 or (at `attn_layer_indices`) an attention sublayer, then a
    gated SiLU MLP; partial RoPE."""
    layers = _get(raw, "num_hidden_layers", int, source)
    attn = raw.get("attn_layer_indices") or []
    if not isinstance(attn, list) or not all(isinstance(i, int) and 0 <= i < layers for i in attn):
        raise CheckpointError(f"{source}: key 'attn_layer_indices' must be a list of layer indices below {layers}, "
                              f"got {attn!r}")
    _refuse_unless(raw, source, "hidden_act", ("silu",), "the MLP's activation must be silu")
    d_model = _get(raw, "hidden_size", int, source)
    blocks = [b for i in range(layers) for b in ("attention" if i in attn else "mamba2", "mlp")]
    return MambaConfig(
        n_layer=layers, blocks=tuple(blocks), family="bamba",
        **_mamba_fields_hf(raw, source, d_model, _expanded(raw, source, d_model)),
        norm_eps=_get(raw, "rms_norm_eps", float, source, 1e-5),
        **_attention_fields(raw, source, d_model),
        mlp_size=_get(raw, "intermediate_size", int, source), mlp_bias=_get(raw, "mlp_bias", bool, source, False),
        **_vocab_and_head(raw, source),
    )


_GRANITE_TYPES = {"mamba": "mamba2", "linear_attention": "mamba2", "attention": "attention", "full_attention": "attention"}


def _granite(raw: dict, source: str) -> MambaConfig:
    """Granite-4.0-H (dense): each layer a Mamba-2 or attention sublayer, then the shared gated
    SiLU MLP; the embedding, residual, attention and logits multipliers; RoPE or none."""
    if raw.get("num_local_experts", 0) not in (0, None):
        raise CheckpointError(f"{source}: key 'num_local_experts' is {raw['num_local_experts']!r}; mixture-of-experts "
                              "layers are not supported yet (only dense Granite-4.0-H models)")
    layers = _get(raw, "num_hidden_layers", int, source)
    types = raw.get("layer_types") or raw.get("layers_block_type")
    if not isinstance(types, list) or len(types) != layers or not all(t in _GRANITE_TYPES for t in types):
        raise CheckpointError(f"{source}: key 'layer_types' must list {layers} of 'mamba' and 'attention', got {types!r}")
    position = raw.get("position_embedding_type") or "nope"
    if position not in ("rope", "nope"):
        raise CheckpointError(f"{source}: key 'position_embedding_type' is {position!r}; 'rope' and 'nope' are supported")
    _refuse_unless(raw, source, "hidden_act", ("silu",), "the MLP's activation must be silu")
    d_model = _get(raw, "hidden_size", int, source)
    blocks = [b for t in types for b in (_GRANITE_TYPES[t], "mlp")]
    attention = _attention_fields(raw, source, d_model, rope=position == "rope")
    attention["attn_scale"] = _get(raw, "attention_multiplier", float, source, attention["attn_head_dim"] ** -0.5)
    return MambaConfig(
        n_layer=layers, blocks=tuple(blocks), family="granitemoehybrid",
        **_mamba_fields_hf(raw, source, d_model, _expanded(raw, source, d_model)),
        norm_eps=_get(raw, "rms_norm_eps", float, source, 1e-6),
        **attention,
        mlp_size=_get(raw, "shared_intermediate_size", int, source),
        embedding_multiplier=float(_get(raw, "embedding_multiplier", float, source, 1.0)),
        logits_multiplier=1.0 / _get(raw, "logits_scaling", float, source, 1.0),
        multipliers=(("residual_multiplier", float(_get(raw, "residual_multiplier", float, source, 1.0))),),
        **_vocab_and_head(raw, source),
    )


def _multipliers(raw: dict, source: str, key: str, n: int) -> tuple[float, ...]:
    value = raw.get(key)
    if value is None:
        return (1.0,) * n
    if (not isinstance(value, list) or len(value) != n
            or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in value)):
        raise CheckpointError(f"{source}: key '{key}' must be a list of {n} finite numbers, got {value!r}")
    return tuple(float(v) for v in value)


def _finite(raw: dict, source: str, key: str) -> float:
    value = raw.get(key, 1.0)
    if value is None:
        return 1.0
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise CheckpointError(f"{source}: key '{key}' must be a finite number, got {value!r}")
    return float(value)


def _falcon_h1(raw: dict, source: str) -> MambaConfig:
    """Falcon-H1: each layer attention and Mamba-2 side by side on one norm (their outputs
    summed), then a gated SiLU MLP; muP multipliers on nearly every product."""
    layers = _get(raw, "num_hidden_layers", int, source)
    _refuse_unless(raw, source, "hidden_act", ("silu",), "the MLP's activation must be silu")
    d_model = _get(raw, "hidden_size", int, source)
    d_ssm = raw.get("mamba_d_ssm")
    d_inner = _get(raw, "mamba_d_ssm", int, source) if d_ssm is not None else _expanded(raw, source, d_model)
    mamba = _mamba_fields_hf(raw, source, d_model, d_inner)
    out_bias = _get(raw, "projectors_bias", bool, source, False)
    if out_bias != mamba["proj_bias"]:
        raise CheckpointError(f"{source}: keys 'mamba_proj_bias' ({mamba['proj_bias']}) and 'projectors_bias' "
                              f"({out_bias}) differ; only equal in_proj and out_proj biases are supported")
    names = ("ssm_in_multiplier", "ssm_out_multiplier", "attention_in_multiplier", "attention_out_multiplier",
             "key_multiplier")
    return MambaConfig(
        n_layer=layers, blocks=("mamba2+attention", "mlp") * layers, family="falcon_h1", **mamba,
        ssm_norm=_get(raw, "mamba_rms_norm", bool, source, False),
        norm_before_gate=_get(raw, "mamba_norm_before_gate", bool, source, True),
        norm_eps=_get(raw, "rms_norm_eps", float, source, 1e-5),
        **_attention_fields(raw, source, d_model),
        mlp_size=_get(raw, "intermediate_size", int, source), mlp_bias=_get(raw, "mlp_bias", bool, source, False),
        embedding_multiplier=_finite(raw, source, "embedding_multiplier"),
        logits_multiplier=_finite(raw, source, "lm_head_multiplier"),
        multipliers=tuple((n, _finite(raw, source, n)) for n in names)
        + (("ssm_multipliers", _multipliers(raw, source, "ssm_multipliers", 5)),
           ("mlp_multipliers", _multipliers(raw, source, "mlp_multipliers", 2))),
        **_vocab_and_head(raw, source),
    )


_HYBRIDS = {"nemotron_h": _nemotron_h, "bamba": _bamba, "granitemoehybrid": _granite, "falcon_h1": _falcon_h1}
