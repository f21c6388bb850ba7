"""Reading a checkpoint folder (HF or original state-spaces format) into MambaWeights, strictly."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .config import MambaConfig
from .errors import CheckpointError
from .model import LayerWeights, MambaWeights

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def parse_dtype(dtype) -> torch.dtype:
    """A storage dtype from its name ("bfloat16", "bf16", ...) or a torch dtype."""
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype in DTYPES:
        return DTYPES[dtype]
    raise ValueError(f"dtype must be one of float32, bfloat16, float16 (or a torch dtype), got {dtype!r}")


def expected_shapes(c: MambaConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the HF layout holds for this config, by HF name."""
    E, R, N, K, d = c.d_inner, c.dt_rank, c.d_state, c.d_conv, c.d_model
    shapes = {"backbone.embeddings.weight": (c.vocab_size, d), "backbone.norm_f.weight": (d,)}
    for i in range(c.n_layer):
        p = f"backbone.layers.{i}."
        shapes[p + "norm.weight"] = (d,)
        shapes[p + "mixer.in_proj.weight"] = (2 * E, d)
        shapes[p + "mixer.conv1d.weight"] = (E, 1, K)
        shapes[p + "mixer.x_proj.weight"] = (R + 2 * N, E)
        shapes[p + "mixer.dt_proj.weight"] = (E, R)
        shapes[p + "mixer.dt_proj.bias"] = (E,)
        shapes[p + "mixer.A_log"] = (E, N)
        shapes[p + "mixer.D"] = (E,)
        shapes[p + "mixer.out_proj.weight"] = (d, E)
        if c.conv_bias:
            shapes[p + "mixer.conv1d.bias"] = (E,)
        if c.proj_bias:
            shapes[p + "mixer.in_proj.bias"] = (2 * E,)
            shapes[p + "mixer.out_proj.bias"] = (d,)
    if not c.tie_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, d)
    return shapes


def _weight_files(folder: Path) -> list[Path]:
    """The weights files of a checkpoint folder, shards resolved through their index."""
    for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        index = folder / index_name
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
                names = sorted(set(weight_map.values()))
            except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as e:
                raise CheckpointError(f"{index}: not a valid shard index ({type(e).__name__}: {e})") from None
            files = [folder / n for n in names]
            for f in files:
                if not f.exists():
                    raise CheckpointError(f"{index}: shard file {f.name} is missing")
            return files
    for name in ("model.safetensors", "pytorch_model.bin"):
        if (folder / name).exists():
            return [folder / name]
    raise CheckpointError(f"{folder}: no weights file (model.safetensors, pytorch_model.bin or a shard index)")


def _read_file(path: Path) -> dict[str, torch.Tensor]:
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            tensors = load_file(str(path))
        else:
            # weights_only: a .bin file is never allowed to run code while unpickling.
            tensors = torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as e:  # the libraries raise many types for truncated or corrupt files
        raise CheckpointError(f"{path}: cannot read weights ({_one_line(e)})") from None
    if not isinstance(tensors, dict) or not all(isinstance(t, torch.Tensor) for t in tensors.values()):
        raise CheckpointError(f"{path}: not a mapping of tensor names to tensors")
    return tensors


def _one_line(e: Exception) -> str:
    """A library's (often multi-line) error as one short line."""
    text = str(e)
    if "weights_only" in text or "GLOBAL" in text:
        return "it holds pickled objects other than tensors, which are never unpickled"
    text = " ".join(text.split())
    return f"{type(e).__name__}: {text[:200]}"


def read_tensors(folder: Path, config: MambaConfig) -> tuple[dict[str, torch.Tensor], dict[str, Path]]:
    """All tensors by HF name, checked against the config: (tensors, file each came from)."""
    tensors: dict[str, torch.Tensor] = {}
    origin: dict[str, Path] = {}
    for path in _weight_files(folder):
        for name, t in _read_file(path).items():
            # The original format names the embedding in the singular.
            if name == "backbone.embedding.weight":
                name = "backbone.embeddings.weight"
            if name in tensors:
                raise CheckpointError(f"{path}: tensor '{name}' also appears in {origin[name]}")
            tensors[name] = t
            origin[name] = path
    files = ", ".join(sorted({p.name for p in origin.values()})) or "weights"
    # Checkpoints saved from a tied model (the original format's torch.save of a state dict)
    # may repeat the embedding as lm_head.weight: accept it only if it is the same tensor.
    if config.tie_embeddings and "lm_head.weight" in tensors:
        head, emb = tensors.pop("lm_head.weight"), tensors.get("backbone.embeddings.weight")
        if emb is None or head.shape != emb.shape or not torch.equal(head, emb):
            raise CheckpointError(
                f"{origin['lm_head.weight']}: tensor 'lm_head.weight' differs from the embedding, "
                "but the config ties them (tie_word_embeddings / tie_embeddings is true)"
            )
    expected = expected_shapes(config)
    missing = [n for n in expected if n not in tensors]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"{folder / files}: missing tensor '{missing[0]}'{more}")
    unexpected = sorted(n for n in tensors if n not in expected)
    if unexpected:
        more = f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""
        raise CheckpointError(
            f"{origin[unexpected[0]]}: unexpected tensor '{unexpected[0]}'{more} for the sizes in config.json"
        )
    for name, shape in expected.items():
        t = tensors[name]
        if tuple(t.shape) != shape:
            raise CheckpointError(
                f"{origin[name]}: tensor '{name}' has shape {tuple(t.shape)}, config.json implies {shape}"
            )
        if not t.is_floating_point():
            raise CheckpointError(f"{origin[name]}: tensor '{name}' has dtype {t.dtype}, expected floating point")
        if not torch.isfinite(t).all():
            raise CheckpointError(f"{origin[name]}: tensor '{name}' holds NaN or inf values")
    return tensors, origin


def build_weights(
    config: MambaConfig, tensors: dict[str, torch.Tensor], origin: dict[str, Path], device, dtype: torch.dtype
) -> MambaWeights:
    """Moves checked tensors to the device: large matrices in `dtype`, the rest in float32."""
    fp16_max = torch.finfo(torch.float16).max

    def big(name):
        t = tensors[name]
        if dtype == torch.float16 and (peak := t.abs().max().item()) > fp16_max:
            raise CheckpointError(
                f"{origin[name]}: tensor '{name}' holds values up to {peak:.3g}, beyond float16's range; "
                "load it with dtype='bfloat16' or 'float32'"
            )
        return t.to(device=device, dtype=dtype).contiguous()

    def small(name):
        return None if name not in tensors else tensors[name].to(device=device, dtype=torch.float32).contiguous()

    layers = []
    for i in range(config.n_layer):
        p = f"backbone.layers.{i}."
        layers.append(
            LayerWeights(
                norm_w=small(p + "norm.weight"),
                in_proj_w=big(p + "mixer.in_proj.weight"),
                in_proj_b=small(p + "mixer.in_proj.bias"),
                conv_w=small(p + "mixer.conv1d.weight")[:, 0, :],
                conv_b=small(p + "mixer.conv1d.bias"),
                x_proj_w=big(p + "mixer.x_proj.weight"),
                dt_proj_w=big(p + "mixer.dt_proj.weight"),
                dt_bias=small(p + "mixer.dt_proj.bias"),
                A=-torch.exp(small(p + "mixer.A_log")),
                D=small(p + "mixer.D"),
                out_proj_w=big(p + "mixer.out_proj.weight"),
                out_proj_b=small(p + "mixer.out_proj.bias"),
            )
        )
    embedding = big("backbone.embeddings.weight")
    lm_head = embedding if config.tie_embeddings else big("lm_head.weight")
    return MambaWeights(embedding=embedding, layers=layers, norm_f=small("backbone.norm_f.weight"), lm_head=lm_head)


def load_checkpoint(path, device, dtype: torch.dtype) -> tuple[MambaConfig, MambaWeights]:
    folder = Path(path)
    if not folder.exists():
        raise CheckpointError(f"{folder}: no such checkpoint folder")
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: a checkpoint is a folder holding config.json and weights")
    config = MambaConfig.from_file(folder / "config.json")
    tensors, origin = read_tensors(folder, config)
    return config, build_weights(config, tensors, origin, device, dtype)
