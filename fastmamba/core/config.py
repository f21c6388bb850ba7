"""MambaConfig: the model's sizes, read from either checkpoint format's config.json."""

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

    @property
    def n_heads(self) -> int:
        return self.d_inner // self.head_dim

    def __post_init__(self):
        # Derived sizes are resolved here so every reader sees plain numbers.
        if self.d_inner == 0:
            object.__setattr__(self, "d_inner", 2 * self.d_model)
        if self.dt_rank == 0:
            object.__setattr__(self, "dt_rank", math.ceil(self.d_model / 16))

    @classmethod
    def from_dict(cls, raw: dict, source: str = "config.json") -> "MambaConfig":
        """Builds a config from an HF (`hidden_size`, ...) or original (`d_model`, ...) dict."""
        if "hidden_size" in raw:
            config = _from_hf(raw, source)
        elif "d_model" in raw:
            config = _from_original(raw, source)
        else:
            raise CheckpointError(
                f"{source}: neither 'hidden_size' (HF format) nor 'd_model' (original format) is present"
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


_MODEL_TYPES = ("mamba", "falcon_mamba", "mamba2")


def _from_hf(raw: dict, source: str) -> MambaConfig:
    model_type = raw.get("model_type", "mamba")
    if model_type not in _MODEL_TYPES:
        raise CheckpointError(
            f"{source}: model_type is {model_type!r}; supported: 'mamba' (Mamba-1), 'falcon_mamba' and 'mamba2' "
            "(hybrids such as Jamba, Zamba2 or Nemotron-H are not)"
        )
    if model_type == "mamba2":
        return _mamba2_from_hf(raw, source)
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
            **fields) -> MambaConfig:
    """A Mamba-2 config, its head and group counts checked against each other."""
    d_inner = expand * d_model
    if d_inner % head_dim:
        raise CheckpointError(f"{source}: d_inner {d_inner} (expand x hidden size) is not a multiple of head_dim {head_dim}")
    if n_heads is not None and n_heads != d_inner // head_dim:
        raise CheckpointError(f"{source}: key 'num_heads' is {n_heads}, but expand x hidden size / head_dim is "
                              f"{d_inner // head_dim}")
    if (d_inner // head_dim) % n_groups:
        raise CheckpointError(f"{source}: key 'n_groups' ({n_groups}) must divide the {d_inner // head_dim} heads")
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
    """The layer fields of _MAMBA2_LAYER_KEYS from `raw` (config.json, or its ssm_cfg)."""
    return {field: _get(raw, hf_key if hf else key, kind, source, hf_default if hf else default)
            for field, hf_key, key, kind, hf_default, default in _MAMBA2_LAYER_KEYS}


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
