"""config.json's `quantization_config`: the FP8 checkpoints fastmamba reads, and every other
scheme refused by the field and value that rule it out.

Read: compressed-tensors (vLLM's and llm-compressor's format: `quant_method:
"compressed-tensors"`, format `float-quantized` or `naive-quantized`) with float8 e4m3
weights, symmetric, a scale per tensor, per output channel or per block (`strategy: tensor |
channel | block`, `block_structure: [rows, columns]`). A quantized `<name>.weight` is stored
as F8_E4M3 beside `<name>.weight_scale` (float32 or 16-bit: () or (1,) a tensor, (out, 1)
a channel, (ceil(out / rows), ceil(in / columns)) a block), and w = weight * scale. Static
activation scales (`input_activations` with `dynamic: false`, stored as `<name>.input_scale`)
are read and left unused: fastmamba's products take float32 activations (an activations'
scheme of other values, int8 or fp4, is refused). Which modules are
quantized (`targets`, `ignore`) the weights' own dtypes say.

Read too: NVIDIA ModelOpt's FP8 checkpoints (hf_quant_config.json's `quantization`, or
config.json's quantization_config with `quant_method: "modelopt"`), whose tensors lie in the
same layout: `quant_algo` FP8 (a scale a tensor, static activation scales),
FP8_PER_CHANNEL_PER_TOKEN (a scale a row) or FP8_PB_WO (128 x 128 blocks); `exclude_modules`
the weights' dtypes say again. An FP8 KV cache's scales (`kv_cache_quant_algo: "FP8"`: `k_scale` and `v_scale`
beside an attention sublayer's projections) are read and left unused: the cache stays 16-bit.

Torch-free at import, as config.py is.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from fastmamba.core.errors import CheckpointError

STRATEGIES = ("tensor", "channel", "block")
FORMATS = ("float-quantized", "naive-quantized")
# compressed-tensors' preset schemes of FP8 weights, by the group name that names them
_FP8_ACTS = dict(num_bits=8, type="float")
PRESETS = {
    "FP8": dict(strategy="tensor", input_activations=dict(dynamic=False, **_FP8_ACTS)),
    "FP8_DYNAMIC": dict(strategy="channel", input_activations=dict(dynamic=True, **_FP8_ACTS)),
    "FP8_BLOCK": dict(strategy="block", block_structure=[128, 128], input_activations=dict(dynamic=True, **_FP8_ACTS)),
}


@dataclass(frozen=True)
class Fp8Scheme:
    """How an FP8 checkpoint's weights are scaled: the strategies its groups use, the block
    shapes of its `block` groups, and whether it stores static activation scales."""

    strategies: tuple[str, ...]  # among STRATEGIES
    blocks: tuple[tuple[int, int], ...] = ()  # (rows, columns) of each `block` group
    input_scales: bool = False  # '<name>.input_scale' tensors beside the weights (unused)
    kv_scales: bool = False  # an FP8 KV cache's 'k_scale' and 'v_scale' beside attention's projections (unused)

    def scale_shapes(self, out: int, k: int) -> list[tuple[tuple[int, ...], str, tuple[int, int] | None]]:
        """The shapes a (out, k) weight's scale may have: (shape, strategy, block)."""
        shapes = []
        if "tensor" in self.strategies:
            shapes += [((), "tensor", None), ((1,), "tensor", None)]
        if "channel" in self.strategies:
            shapes += [((out, 1), "channel", None), ((out,), "channel", None)]
        for r, c in self.blocks:
            shapes.append(((-(-out // r), -(-k // c)), "block", (r, c)))
        return shapes


# NVIDIA ModelOpt's FP8 schemes, by their quant_algo (ModelOpt writes the last one lower-case too)
MODELOPT_FP8 = {
    "FP8": Fp8Scheme(("tensor",), input_scales=True),
    "FP8_PER_CHANNEL_PER_TOKEN": Fp8Scheme(("channel",)),
    "FP8_PB_WO": Fp8Scheme(("block",), blocks=((128, 128),)),
}


def modelopt_scheme(q, where: str, source: str) -> Fp8Scheme:
    """The scheme of ModelOpt's quantization object (`where`: its path in the file, for the
    errors), or a CheckpointError naming the field and its value."""
    if not isinstance(q, dict):
        _refuse(where, q, source, "ModelOpt's quantization is an object")
    algo = q.get("quant_algo")
    scheme = MODELOPT_FP8.get(algo.upper()) if isinstance(algo, str) else None
    if scheme is None:
        _refuse(f"{where}.quant_algo", algo, source, f"of NVIDIA ModelOpt's schemes fastmamba reads the FP8 ones: "
                f"{', '.join(MODELOPT_FP8)}")
    kv = q.get("kv_cache_quant_algo")
    if kv not in (None, "FP8"):
        _refuse(f"{where}.kv_cache_quant_algo", kv, source, "fastmamba reads an FP8 KV cache's scales (and leaves "
                "them unused: its cache stays 16-bit), no other")
    # (config.json's form of ModelOpt's file says the KV cache's scheme in compressed-tensors' terms)
    kv_scheme = q.get("kv_cache_scheme")
    if kv_scheme is not None:
        _float8(kv_scheme, f"{where}.kv_cache_scheme", source, "an FP8 KV cache's scales")
    return replace(scheme, kv_scales=kv == "FP8" or kv_scheme is not None)


def fp8_scheme(q, source: str) -> Fp8Scheme:
    """The scheme of a `quantization_config`, or a CheckpointError naming the field (as a
    path: quantization_config.config_groups.group_0.weights.num_bits) and its value."""
    if not isinstance(q, dict):
        raise CheckpointError(f"{source}: key 'quantization_config' is {q!r}, not an object")
    method = q.get("quant_method")
    if method == "modelopt":
        return modelopt_scheme(q, "quantization_config", source)
    if method != "compressed-tensors":
        raise CheckpointError(
            f"{source}: quantization_config.quant_method is {method!r}: fastmamba reads FP8 weights in the "
            "compressed-tensors format and NVIDIA ModelOpt's (quant_method 'compressed-tensors' or 'modelopt'); load "
            "a float32, bfloat16 or float16 checkpoint, or quantize one at load with dtype='fp8'")
    where = "quantization_config"
    _one_of(q, "format", FORMATS + ("mixed-precision",), where, source)
    if q.get("quantization_status", "compressed") != "compressed":
        _refuse(where + ".quantization_status", q["quantization_status"], source,
                "the weights are not stored compressed ('compressed')")
    for key in ("kv_cache_scheme", "sparsity_config", "transform_config"):
        if q.get(key):
            _refuse(f"{where}.{key}", q[key], source, "fastmamba reads FP8 weights alone")
    groups = q.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        _refuse(where + ".config_groups", groups, source, "an FP8 checkpoint has at least one group of weights")
    strategies, blocks, input_scales = set(), set(), False
    for name, group in groups.items():
        at = f"{where}.config_groups.{name}"
        if isinstance(group, list):  # a preset's name, its targets
            if name not in PRESETS:
                _refuse(at, name, source, f"of the preset schemes fastmamba reads FP8 ones: {', '.join(PRESETS)}")
            preset = PRESETS[name]
            group = dict(weights=dict(num_bits=8, type="float", **{k: v for k, v in preset.items()
                                                                  if k != "input_activations"}),
                         input_activations=preset["input_activations"])
        if not isinstance(group, dict):
            _refuse(at, group, source, "a group is an object")
        if group.get("format") is not None:
            _one_of(group, "format", FORMATS, at, source)
        if group.get("output_activations") is not None:
            _refuse(at + ".output_activations", group["output_activations"], source, "fastmamba reads FP8 weights alone")
        strategy, block = _weights(group.get("weights"), at + ".weights", source)
        strategies.add(strategy)
        if block:
            blocks.add(block)
        acts = group.get("input_activations")
        if acts is not None:  # (read as float8 or not at all: fastmamba's products take float32 activations)
            _float8(acts, at + ".input_activations", source, "FP8 activations' scales")
            input_scales = input_scales or not acts.get("dynamic", False)
    return Fp8Scheme(tuple(s for s in STRATEGIES if s in strategies), tuple(sorted(blocks)), input_scales)


def _weights(w, at: str, source: str) -> tuple[str, tuple[int, int] | None]:
    """A group's weight arguments: (strategy, block shape or None)."""
    if not isinstance(w, dict):
        _refuse(at, w, source, "fastmamba reads quantized weights (not activations alone)")
    _float8(w, at, source, "weights")
    if w.get("dynamic", False) is not False:
        _refuse(f"{at}.dynamic", w["dynamic"], source, "fastmamba reads weights of float8 values (dynamic False)")
    for key in ("scale_dtype", "zp_dtype", "group_size"):
        if w.get(key) is not None:
            _refuse(f"{at}.{key}", w[key], source, "not of an FP8 scheme fastmamba reads")
    strategy = _one_of(w, "strategy", STRATEGIES, at, source)
    if strategy != "block":
        return strategy, None
    b = w.get("block_structure")
    if not (isinstance(b, list) and len(b) == 2 and all(isinstance(n, int) and not isinstance(n, bool) and n > 0
                                                        for n in b)):
        _refuse(at + ".block_structure", b, source, "a block is [rows, columns]")
    return strategy, (b[0], b[1])


def _float8(args, at: str, source: str, what: str) -> None:
    """Quantization arguments of float8 values, symmetric (an FP8 KV cache's, activations'), or a
    CheckpointError naming the field."""
    if not isinstance(args, dict):
        _refuse(at, args, source, "quantization arguments are an object")
    for key, value in (("num_bits", 8), ("type", "float"), ("symmetric", True)):
        got = args.get(key, value if key == "symmetric" else None)
        if got != value:
            _refuse(f"{at}.{key}", got, source, f"fastmamba reads {what} of float8 values ({key} {value!r})")


def _one_of(d: dict, key: str, allowed: tuple[str, ...], at: str, source: str) -> str:
    value = d.get(key)
    if value not in allowed:
        _refuse(f"{at}.{key}", value, source, f"fastmamba reads {' or '.join(repr(a) for a in allowed)}")
    return value


def _refuse(field: str, value, source: str, why: str):
    raise CheckpointError(f"{source}: {field} is {value!r}: not supported ({why})")
