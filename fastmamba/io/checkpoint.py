"""Reading a checkpoint folder (HF or original state-spaces format; FP8 ones in the
compressed-tensors format) into MambaWeights, strictly."""

from __future__ import annotations

import json
import os
import re
import warnings
from dataclasses import replace
from pathlib import Path

import torch

from fastmamba.core.config import MambaConfig
from fastmamba.core.config_fields import eos_ids
from fastmamba.core.dtypes import embedding_dtype
from fastmamba.core.errors import CheckpointError
from fastmamba.core.families import family, first_sublayer, fold_multipliers, sublayer, sublayers
from fastmamba.core.fp8 import FP8, Fp8Weight, quantize
from fastmamba.core.layers import LAYER_KINDS
from fastmamba.core.model import MambaWeights
from fastmamba.core.quant_config import Fp8Scheme, modelopt_scheme
from fastmamba.io.files import INDEX_FILES, WEIGHTS_FILES, inside, readable_file


def expected_shapes(c: MambaConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the HF layout holds for this config, by HF name (the family's)."""
    fam = family(c)
    shapes = {fam.embedding: (c.vocab_size, c.d_model), fam.norm_f: (c.d_model,)}
    for sub in sublayers(c):
        shapes.update(LAYER_KINDS[sub.kind].shapes(c, sub, fam))
    if not c.tie_embeddings:
        shapes[fam.lm_head] = (c.vocab_size, c.d_model)
    return shapes


def _weight_files(folder: Path) -> list[Path]:
    """The weights files of a checkpoint folder, shards resolved through their index."""
    for index_name in INDEX_FILES:
        index = folder / index_name
        if index.exists():
            index = inside(folder, index_name)
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
                items = sorted(weight_map.items())
            except (OSError, json.JSONDecodeError, UnicodeDecodeError, RecursionError, KeyError, TypeError,
                    AttributeError) as e:
                raise CheckpointError(f"{index}: not a valid shard index ({type(e).__name__}: {e})") from None
            for tensor, shard in items:
                if not isinstance(shard, str):
                    raise CheckpointError(f"{index}: weight_map['{tensor}'] is {shard!r}, not a file name")
            files = [inside(folder, n) for n in sorted({shard for _, shard in items})]
            for f in files:
                if not os.path.lexists(f):
                    raise CheckpointError(f"{index}: shard file {f.name} is missing")
            return [readable_file(f) for f in files]
    for name in WEIGHTS_FILES:
        if os.path.lexists(folder / name):  # (lexists: a broken or looping link is named, not skipped)
            return [readable_file(inside(folder, name))]
    raise CheckpointError(f"{folder}: no weights file (model.safetensors, pytorch_model.bin or a shard index)")


def _dtype_label(dtype: torch.dtype) -> str:
    """A torch dtype in safetensors' spelling, lower case: f32, bf16, f8_e4m3, i64, ..."""
    return {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16", torch.float64: "f64"}.get(
        dtype, "f8" + str(dtype).removeprefix("torch.float8") if "float8" in str(dtype) else str(dtype).removeprefix("torch."))


# The tensor dtypes the loader reads (float8 e4m3 ones where config.json names an FP8 scheme).
_FLOAT_DTYPES = ("f32", "f16", "bf16", "f64")


class _WeightsFile:
    """One weights file: its tensors' names, shapes and dtypes from the header alone, so a
    config can be checked against them before any data is read; the data on demand."""

    def __init__(self, path: Path):
        self.path = path
        self._lazy: dict[str, torch.Tensor] | None = None  # a .bin's tensors, memory-mapped
        try:
            if path.suffix == ".safetensors":
                from safetensors import safe_open

                with safe_open(str(path), framework="pt") as f:
                    slices = {name: f.get_slice(name) for name in f.keys()}
                    # safetensors names its dtypes F16, BF16, F32, F64, F8_E4M3, I64, BOOL, ...
                    self.header = {n: (tuple(s.get_shape()), s.get_dtype().lower()) for n, s in slices.items()}
            else:
                try:
                    self._lazy = _torch_load(path)
                except Exception as e:  # (a bad pickle or zip fails deep inside torch, as any type)
                    reason = one_line(e) if _pickled_objects(e) else f"not a checkpoint torch.load reads: {one_line(e)}"
                    raise CheckpointError(f"{path}: cannot read weights ({reason})") from None
                if not isinstance(self._lazy, dict) or not all(isinstance(t, torch.Tensor) for t in self._lazy.values()):
                    raise CheckpointError(f"{path}: not a mapping of tensor names to tensors")
                self.header = {n: (tuple(t.shape), _dtype_label(t.dtype)) for n, t in self._lazy.items()}
        except CheckpointError:
            raise
        except Exception as e:  # the libraries raise many types for truncated or corrupt files
            raise CheckpointError(f"{path}: cannot read weights ({one_line(e)})") from None
        for name in self.header:
            if not isinstance(name, str):
                raise CheckpointError(f"{path}: tensor name {name!r} is not a string")

    def tensors(self) -> dict[str, torch.Tensor]:
        if self._lazy is not None:
            return self._lazy
        try:
            from safetensors.torch import load_file

            return load_file(str(self.path))
        except Exception as e:
            raise CheckpointError(f"{self.path}: cannot read weights ({one_line(e)})") from None


def _torch_load(path: Path):
    # weights_only: a .bin file is never allowed to run code while unpickling. torch warns
    # (three lines) before it refuses such a file; the refusal itself is the message.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:  # memory-mapped: the header is read now, each tensor's data when it is used
            return torch.load(str(path), map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as e:
            if "mmap" not in str(e):
                raise
            return torch.load(str(path), map_location="cpu", weights_only=True)  # the legacy format


def _pickled_objects(e: Exception) -> bool:
    """Whether torch.load refused a pickle for the objects it holds (not a broken file)."""
    return "GLOBAL" in str(e) or "Unsupported global" in str(e)


def one_line(e: Exception) -> str:
    """A library's (often multi-line) error as one short line."""
    if _pickled_objects(e):
        return "it holds pickled objects other than tensors, which are never unpickled"
    text = " ".join(str(e).split())
    if "Weights only load failed" in text:  # (torch's preamble, whatever the pickle's fault; the fault after it)
        text = text.split("WeightsUnpickler error:")[-1].split(" Check the documentation")[0].strip()
    return f"{type(e).__name__}: {text[:200]}"


def read_tensors(folder: Path, config: MambaConfig) -> tuple[dict[str, torch.Tensor], dict[str, Path]]:
    """All tensors by HF name, checked against the config: (tensors, file each came from).

    Names, shapes and dtypes are checked from the files' headers first, so a config that
    implies absurd sizes costs no more than the files' headers do."""
    opened = [_WeightsFile(path) for path in _weight_files(folder)]
    header: dict[str, tuple[tuple[int, ...], bool]] = {}
    origin: dict[str, Path] = {}
    source: dict[str, tuple[_WeightsFile, str]] = {}  # HF name -> (file, name in the file)
    for f in opened:
        for stored, entry in f.header.items():
            # The original format names the embedding in the singular.
            name = "backbone.embeddings.weight" if stored == "backbone.embedding.weight" else stored
            if name in header:
                raise CheckpointError(f"{f.path}: tensor '{name}' also appears in {origin[name]}")
            header[name], origin[name], source[name] = entry, f.path, (f, stored)
    files = ", ".join(sorted({p.name for p in origin.values()})) or "weights"
    # Checkpoints saved from a tied model (the original format's torch.save of a state dict)
    # may repeat the embedding as lm_head.weight: accepted below if it is the same tensor.
    fam = family(config)
    repeated_head = config.tie_embeddings and fam.lm_head in header
    # The layer count first: expected_shapes enumerates every layer, so it runs only once
    # the files are known to hold them.
    layer = re.compile(re.escape(fam.layer).replace(re.escape("{i}"), r"(\d+)"))
    present = {int(m.group(1)) for n in header if (m := layer.match(n))}
    if config.n_layer > len(present):
        first = next(i for i in range(config.n_layer) if i not in present)
        norm = sublayer(config, first_sublayer(config, first)).norm
        raise CheckpointError(
            f"{folder / files}: missing tensor '{norm}': config.json says {config.n_layer} layers, the weights "
            f"hold {len(present)}"
        )
    expected = expected_shapes(config)
    missing = [n for n in expected if n not in header]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"{folder / files}: missing tensor '{missing[0]}'{more}{_other_layer_kind(config, header)}")
    # An FP8 checkpoint's float8 weights: each with its scale, perhaps a static activation scale (unused);
    # an FP8 KV cache's scales (unused)
    fp8 = _fp8_companions(config, expected, header)
    companions = {n for names in fp8.values() for n in names if n} | _kv_scales(config, expected, header)
    unexpected = sorted(n for n in header if n not in expected and n not in companions
                        and not (repeated_head and n == "lm_head.weight"))
    if unexpected:
        more = f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""
        raise CheckpointError(
            f"{origin[unexpected[0]]}: unexpected tensor '{unexpected[0]}'{more} for the sizes in config.json"
        )
    layouts = {}  # float8 weight -> (its scale's name, strategy, block)
    for name, shape in expected.items():
        if header[name][0] != shape:
            raise CheckpointError(
                f"{origin[name]}: tensor '{name}' has shape {header[name][0]}, config.json implies {shape}"
            )
        if name in fp8:
            layouts[name] = _fp8_layout(config, name, shape, fp8[name][0], header, origin)
            continue
        if header[name][1].startswith("f8"):
            why = ("config.json has no quantization_config (where an FP8 checkpoint says how its values are scaled)"
                   if config.fp8 is None else
                   "FP8 checkpoints hold float8 (e4m3) values in the projections' matrices only")
            raise CheckpointError(f"{origin[name]}: tensor '{name}' is float8 ({header[name][1]}), but {why}; "
                                  "load a float32, bfloat16 or float16 checkpoint (dtype='fp8' quantizes one at load)")
        if header[name][1] not in _FLOAT_DTYPES:
            raise CheckpointError(f"{origin[name]}: tensor '{name}' is {header[name][1]}, not floating point "
                                  "(float32, bfloat16, float16 or float64)")
    data = {id(f): f.tensors() for f in opened}
    tensors = {name: data[id(f)][stored] for name, (f, stored) in source.items()}
    for name, (scale, strategy, block) in layouts.items():
        tensors[name] = _fp8_weight(tensors[name], tensors[scale], strategy, block, origin[scale], scale)
    for name in companions:
        tensors.pop(name, None)
    if repeated_head:
        head, emb = tensors.pop(fam.lm_head), tensors[fam.embedding]
        if head.shape != emb.shape or not torch.equal(_dense(head), _dense(emb)):
            raise CheckpointError(
                f"{origin[fam.lm_head]}: tensor '{fam.lm_head}' differs from the embedding, "
                "but the config ties them (tie_word_embeddings / tie_embeddings is true)"
            )
    for name in expected:
        if not torch.isfinite(_dense(tensors[name])).all():
            raise CheckpointError(f"{origin[name]}: tensor '{name}' holds NaN or inf values")
    fold_multipliers(config, tensors)
    return tensors, origin


def _fp8_companions(config: MambaConfig, expected: dict, header: dict) -> dict[str, tuple[str, str | None]]:
    """An FP8 checkpoint's float8 matrices: {weight: (its scale's name, its static activation
    scale's name where the scheme stores them and the file holds one, else None)}."""
    if config.fp8 is None:
        return {}
    out = {}
    for name, shape in expected.items():
        if name.endswith(".weight") and len(shape) == 2 and header[name][1].startswith("f8"):
            stem = name.removesuffix("weight")
            out[name] = (stem + "weight_scale",
                         stem + "input_scale" if config.fp8.input_scales and stem + "input_scale" in header else None)
    return out


def _kv_scales(config: MambaConfig, expected: dict, header: dict) -> set[str]:
    """An FP8 KV cache's scales in the files, beside each attention sublayer's projections
    (ModelOpt's `kv_cache_quant_algo: "FP8"`): read and left unused, the cache being 16-bit."""
    if config.fp8 is None or not config.fp8.kv_scales:
        return set()
    stems = [n.removesuffix("k_proj.weight") for n in expected if n.endswith("k_proj.weight")]
    return {stem + scale for stem in stems for scale in ("k_proj.k_scale", "v_proj.v_scale", "k_scale", "v_scale")
            if stem + scale in header}


def _fp8_layout(config: MambaConfig, name: str, shape: tuple[int, int], scale: str, header: dict,
                origin: dict) -> tuple[str, str, tuple[int, int] | None]:
    """A float8 matrix's scale checked against the scheme in config.json: (scale's name,
    strategy, block shape or None)."""
    if header[name][1] != "f8_e4m3":
        raise CheckpointError(f"{origin[name]}: tensor '{name}' is float8 {header[name][1]}: FP8 weights are e4m3 "
                              "(F8_E4M3)")
    if scale not in header:
        raise CheckpointError(f"{origin[name]}: missing tensor '{scale}', the scale of the float8 tensor '{name}'")
    got, dtype = header[scale]
    if dtype not in _FLOAT_DTYPES:
        raise CheckpointError(f"{origin[scale]}: tensor '{scale}' is {dtype}, not floating point")
    shapes = config.fp8.scale_shapes(*shape)
    fits = [(strategy, block) for s, strategy, block in shapes if s == got]
    if not fits:
        implied = " or ".join(f"{s} ({strategy})" for s, strategy, _ in shapes)
        raise CheckpointError(f"{origin[scale]}: tensor '{scale}' has shape {got}; config.json's quantization_config "
                              f"implies {implied} for a {shape} weight")
    return (scale, *fits[0])


def _fp8_weight(data: torch.Tensor, scale: torch.Tensor, strategy: str, block, path: Path, name: str) -> Fp8Weight:
    """A checkpoint's float8 matrix and its scale as an Fp8Weight: a tensor's scale repeated
    for each row (exact: the same float32 number), a channel's or a block's as stored."""
    s = scale.float()
    if strategy == "tensor":
        s = s.reshape(()).expand(data.shape[0])
    elif strategy == "channel":
        s = s.reshape(data.shape[0])
    if not torch.isfinite(s).all():
        raise CheckpointError(f"{path}: tensor '{name}' holds NaN or inf values")
    return Fp8Weight(data.contiguous(), s.contiguous(), block)


def _dense(t):
    """A tensor, or an Fp8Weight's values as float32."""
    return t.dequantize() if isinstance(t, Fp8Weight) else t


def _other_layer_kind(config: MambaConfig, header: dict) -> str:
    """A hint when the weights are of the other Mamba layer than config.json's: Mamba-1's mixer
    has x_proj, Mamba-2's dt_bias and no x_proj."""
    mamba1 = any(n.endswith("x_proj.weight") for n in header)
    mamba2 = any(n.endswith("mixer.dt_bias") for n in header) and not mamba1
    if config.layer == "mamba2" and mamba1:
        return "; the weights are a Mamba-1 model's (they hold x_proj), config.json describes Mamba-2"
    if config.layer == "mamba1" and mamba2:
        return "; the weights are a Mamba-2 model's (they hold dt_bias), config.json describes Mamba-1"
    return ""


def build_weights(
    config: MambaConfig, tensors: dict, origin: dict[str, Path], device, dtype: torch.dtype
) -> MambaWeights:
    """Moves checked tensors to the device: the large matrices in `dtype`, the embedding in
    dtypes.embedding_dtype(dtype), the rest in float32. dtype fp8: the projections (and an
    untied head) as Fp8Weights, quantized here from 16/32-bit values, or as an FP8 checkpoint
    stores them; an FP8 checkpoint's matrices under another dtype are dequantized. Consumes
    `tensors`: each sublayer's are dropped from it once its weights are built."""
    fp8 = dtype == FP8

    def cast(name, to):
        t = _dense(tensors[name])
        # (values past the storage dtype's range would be inf: float16's from any checkpoint,
        # float32's and bfloat16's from a float64 one)
        if (to == torch.float16 or t.dtype == torch.float64) and (peak := t.abs().max().item()) > torch.finfo(to).max:
            hint = "; load it with dtype='bfloat16' or 'float32'" if to == torch.float16 else ""
            raise CheckpointError(
                f"{origin[name]}: tensor '{name}' holds values up to {peak:.3g}, beyond {str(to)[6:]}'s range{hint}")
        return t.to(device=device, dtype=to).contiguous()

    def big(name):
        t = tensors[name]
        if fp8 and isinstance(t, Fp8Weight):  # as the FP8 checkpoint stores it
            return t.to(device)
        if fp8 and config.fp8 is not None:  # a matrix the FP8 checkpoint left unquantized (its `ignore`: often the head)
            return cast(name, embedding_dtype(dtype, device))
        if fp8:
            return quantize(t.to(device))
        return cast(name, dtype)

    def small(name):
        return None if name not in tensors else cast(name, torch.float32)

    fam = family(config)
    layers = []
    for sub in sublayers(config):
        kind = LAYER_KINDS[sub.kind]
        try:
            layers.append(kind.weights(config, sub, fam, big, small))
        except CheckpointError:
            raise
        except ValueError as e:  # (an FP8 checkpoint's block-scaled experts: the grouped kernel takes a scale a row)
            raise CheckpointError(f"{origin[sub.norm]}: the sublayer of '{sub.norm}': {e}") from None
        # its sources dropped once built: experts stored one by one are copied into a stacked
        # tensor, and a model whose tensors are already on the device (the benchmarks' random
        # ones) would otherwise hold every expert twice until the end (Nemotron 3 Nano: 120 GB)
        for name in kind.shapes(config, sub, fam):
            tensors.pop(name, None)
    embedding = cast(fam.embedding, embedding_dtype(dtype, device))
    lm_head = embedding if config.tie_embeddings else big(fam.lm_head)
    return MambaWeights(embedding=embedding, layers=layers, norm_f=small(fam.norm_f), lm_head=lm_head, fp8=fp8)


def load_checkpoint(path, device, dtype: torch.dtype) -> tuple[MambaConfig, MambaWeights]:
    folder = Path(path)
    if not folder.exists():
        raise CheckpointError(f"{folder}: no such checkpoint folder")
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: a checkpoint is a folder holding config.json and weights")
    config = MambaConfig.from_file(inside(folder, "config.json"))
    if os.path.lexists(folder / "hf_quant_config.json") and config.fp8 is None:  # NVIDIA ModelOpt's export
        config = replace(config, fp8=_modelopt_scheme(inside(folder, "hf_quant_config.json")))
    if os.path.lexists(folder / "generation_config.json"):  # (an instruct model's end of turn, often)
        config = _generation_stops(config, inside(folder, "generation_config.json"))
    tensors, origin = read_tensors(folder, config)
    return config, build_weights(config, tensors, origin, device, dtype)


def _json_file(path: Path, what: str):
    """A JSON file's value; one that cannot be read or parsed is a CheckpointError naming it."""
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise CheckpointError(f"{path}: cannot read {what} ({type(e).__name__}: {e})") from None


def _generation_stops(config: MambaConfig, path: Path) -> MambaConfig:
    """config with generation_config.json's eos ids among its default stops, as transformers'
    generate and vLLM stop at them (its other keys are sampling defaults: not read)."""
    raw = _json_file(path, "generation_config.json")
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    if raw.get("eos_token_id") is None:
        return config
    return config.with_stops(eos_ids(raw, str(path)), str(path), "eos_token_id")


def _modelopt_scheme(path: Path) -> Fp8Scheme:
    """The FP8 scheme of NVIDIA ModelOpt's hf_quant_config.json (its `quantization` object)."""
    raw = _json_file(path, "ModelOpt's quantization file")
    if not isinstance(raw, dict) or "quantization" not in raw:
        raise CheckpointError(f"{path}: no 'quantization' object (NVIDIA ModelOpt's file says its scheme there)")
    return modelopt_scheme(raw["quantization"], "quantization", str(path))
