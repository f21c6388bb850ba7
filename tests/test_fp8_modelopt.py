"""NVIDIA ModelOpt's FP8 checkpoints (core/quant_config.py): its three FP8 algorithms (a scale
a tensor with static activation scales, a scale a row, 128 x 128 blocks) in its HF export's
layout, written here as that layout is documented (the library is not a dependency): the
stored e4m3 values loaded as they are, the logits of transformers' model of the dequantized
weights, an FP8 KV cache's scales read and left unused, and the other schemes refused by name."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from conftest import relative_error
from test_fp8 import tiny_mamba

import fastmamba
from fastmamba.core.fp8 import E4M3_MAX, FP8, Fp8Weight

transformers = pytest.importorskip("transformers")

SCALE_SHAPES = {"FP8": "tensor", "FP8_PER_CHANNEL_PER_TOKEN": "channel", "FP8_PB_WO": "block"}


def quantized(w: torch.Tensor, strategy: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w (out, in) as ModelOpt stores it: (e4m3 values, weight_scale, the dequantized matrix);
    scales from the range of the tensor, of each row, or of each 128 x 128 block."""
    out, k = w.shape
    if strategy == "tensor":
        scale = w.abs().max() / E4M3_MAX  # shape ()
        full = scale.expand(out, k)
    elif strategy == "channel":
        scale = w.abs().amax(dim=1, keepdim=True) / E4M3_MAX  # (out, 1)
        full = scale.expand(out, k)
    else:
        r, c = -(-out // 128), -(-k // 128)
        padded = F.pad(w.abs(), (0, c * 128 - k, 0, r * 128 - out))
        scale = padded.view(r, 128, c, 128).amax(dim=(1, 3)) / E4M3_MAX  # (ceil(out/128), ceil(in/128))
        full = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[:out, :k]
    data = (w / full).to(FP8)
    return data, scale.contiguous(), data.float() * full


def export(model, folder, algo: str, kv: bool = False, in_config: bool = False) -> dict[str, torch.Tensor]:
    """`model` saved in ModelOpt's FP8 layout: every Linear but lm_head (exclude_modules) in
    e4m3 beside its weight_scale, FP8's per-tensor input_scale, an attention sublayer's
    k_scale and v_scale where kv; the scheme in hf_quant_config.json (or in config.json's
    quantization_config, in_config). The model's weights become the dequantized ones; returns
    them by module name, with the stored values."""
    from safetensors.torch import load_file, save_file

    model.save_pretrained(folder)
    tensors = load_file(str(folder / "model.safetensors"))
    stored = {}
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear) or name == "lm_head":
            continue
        if name + ".weight" not in tensors:  # (transformers saves Nemotron-H's model.* as backbone.*)
            name = "backbone." + name.removeprefix("model.")
        data, scale, deq = quantized(module.weight.data.float(), SCALE_SHAPES[algo])
        tensors[name + ".weight"], tensors[name + ".weight_scale"] = data, scale
        if algo == "FP8":
            tensors[name + ".input_scale"] = torch.tensor(0.05)
        if kv and name.endswith("k_proj"):
            tensors[name + ".k_scale"] = torch.tensor(1.0)
            tensors[name.removesuffix("k_proj") + "v_proj.v_scale"] = torch.tensor(1.0)
        with torch.no_grad():
            module.weight.copy_(deq)
        stored[name] = data
    save_file(tensors, str(folder / "model.safetensors"))
    quantization = dict(quant_algo=algo, kv_cache_quant_algo="FP8" if kv else None, exclude_modules=["lm_head"])
    if in_config:
        config = json.loads((folder / "config.json").read_text())
        config["quantization_config"] = dict(quant_method="modelopt", **quantization)
        (folder / "config.json").write_text(json.dumps(config))
    else:
        (folder / "hf_quant_config.json").write_text(json.dumps(dict(producer=dict(name="modelopt", version="0.40.0"),
                                                                     quantization=quantization)))
    return stored


@pytest.mark.parametrize("algo", list(SCALE_SHAPES))
def test_a_modelopt_checkpoint_loads_its_values_as_stored(tmp_path, algo):
    """Each FP8 algorithm: every matrix an Fp8Weight of the stored e4m3 bits (not quantized
    again) whose dequantized values are the export's, the excluded head 32-bit, and the logits
    transformers' model of the dequantized weights gives; under dtype float32 the same
    weights dequantized."""
    model = tiny_mamba()
    stored = export(model, tmp_path, algo)
    lm = fastmamba.load(tmp_path, dtype="fp8")
    for i, lw in enumerate(lm.model.weights.layers):
        for m in ("in_proj", "x_proj", "dt_proj", "out_proj"):
            got, name = getattr(lw, m + "_w"), f"backbone.layers.{i}.mixer.{m}"
            assert isinstance(got, Fp8Weight) and got.block == ((128, 128) if algo == "FP8_PB_WO" else None)
            assert torch.equal(got.data.view(torch.uint8), stored[name].view(torch.uint8)), name
            assert torch.equal(got.dequantize(), dict(model.named_modules())[name].weight.float()), name
    assert lm.model.weights.lm_head.dtype == torch.float32
    x = torch.randint(0, 101, (2, 17), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(x).logits
    assert relative_error(lm.forward(x), want) < 1e-5
    assert relative_error(fastmamba.load(tmp_path).forward(x), want) < 1e-5


def test_a_modelopt_hybrid_with_an_fp8_kv_cache_in_config_json(tmp_path):
    """Nemotron-H's shape with its scheme in config.json (quant_method 'modelopt'), per-row
    scales, an FP8 KV cache's k_scale and v_scale beside the attention sublayer's projections:
    read and left unused (the cache stays 16-bit), the logits transformers' model of the
    dequantized weights gives."""
    from test_hybrids import nemotron

    config, model_class = nemotron()
    torch.manual_seed(0)
    model = model_class(config).eval()
    export(model, tmp_path, "FP8_PER_CHANNEL_PER_TOKEN", kv=True, in_config=True)
    lm = fastmamba.load(tmp_path, dtype="fp8")
    assert isinstance(lm.model.weights.layers[1].qkv_w, Fp8Weight)
    x = torch.randint(0, 160, (2, 21), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert relative_error(lm.forward(x), model(x).logits) < 1e-5
    # without the KV cache's scheme, its scales are tensors the model has not
    raw = json.loads((tmp_path / "config.json").read_text())
    raw["quantization_config"]["kv_cache_quant_algo"] = None
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(fastmamba.CheckpointError, match=r"unexpected tensor 'backbone.layers.1.mixer.k_proj.k_scale'"):
        fastmamba.load(tmp_path, dtype="fp8")


def test_modelopts_config_json_form_names_its_kv_cache_in_compressed_tensors_terms(tmp_path):
    """config.json as ModelOpt's converter writes it: `kv_cache_scheme` (float8 values) in place
    of kv_cache_quant_algo, hf_quant_config.json beside it: the k_scale and v_scale read and
    left unused; a KV cache of other values refused by the field."""
    from test_hybrids import nemotron

    config, model_class = nemotron()
    torch.manual_seed(0)
    model = model_class(config).eval()
    export(model, tmp_path, "FP8_PER_CHANNEL_PER_TOKEN", kv=True, in_config=True)
    raw = json.loads((tmp_path / "config.json").read_text())
    q = raw["quantization_config"]
    q.pop("kv_cache_quant_algo")
    q["kv_cache_scheme"] = {"num_bits": 8, "type": "float", "dynamic": False, "strategy": "tensor"}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    x = torch.randint(0, 160, (2, 21), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert relative_error(fastmamba.load(tmp_path, dtype="fp8").forward(x), model(x).logits) < 1e-5
    q["kv_cache_scheme"]["num_bits"] = 4
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(fastmamba.CheckpointError, match=r"quantization_config\.kv_cache_scheme\.num_bits is 4"):
        fastmamba.load(tmp_path, dtype="fp8")


@pytest.mark.parametrize("algo, dense", [("FP8_PER_CHANNEL_PER_TOKEN", "k_proj"), ("FP8_PB_WO", None)])
def test_attention_matrices_that_cannot_share_a_layout_load_as_float32(tmp_path, algo, dense):
    """q, k and v are one product: where they cannot share one FP8 layout (k_proj left
    unquantized, as an `exclude_modules` pattern may leave it; 128-row blocks over q's 64
    rows) they are stacked as float32 values, and the logits are still those of
    transformers' model of the dequantized weights."""
    from safetensors.torch import load_file, save_file
    from test_hybrids import nemotron

    config, model_class = nemotron()
    torch.manual_seed(0)
    model = model_class(config).eval()
    export(model, tmp_path, algo)
    if dense:
        t = load_file(str(tmp_path / "model.safetensors"))
        name = f"backbone.layers.1.mixer.{dense}.weight"
        t[name] = t[name].float() * t.pop(name.replace(".weight", ".weight_scale"))
        save_file(t, str(tmp_path / "model.safetensors"))
    lm = fastmamba.load(tmp_path, dtype="fp8")
    qkv = lm.model.weights.layers[1].qkv_w
    assert not isinstance(qkv, Fp8Weight) and qkv.dtype == torch.float32
    assert isinstance(lm.model.weights.layers[1].o_w, Fp8Weight)  # (the others as stored)
    x = torch.randint(0, 160, (2, 21), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert relative_error(lm.forward(x), model(x).logits) < 1e-5


REFUSED = {  # an edit of hf_quant_config.json's quantization object -> what the error names
    "NVFP4": (lambda q: q.update(quant_algo="NVFP4"), ["quantization.quant_algo", "'NVFP4'", "FP8_PB_WO"]),
    "INT4 AWQ": (lambda q: q.update(quant_algo="W4A16_AWQ"), ["quantization.quant_algo", "'W4A16_AWQ'"]),
    "a KV cache of another kind": (lambda q: q.update(kv_cache_quant_algo="NVFP4"),
                                   ["quantization.kv_cache_quant_algo", "'NVFP4'"]),
    "an algorithm that is not a name": (lambda q: q.update(quant_algo=["FP8"]), ["quantization.quant_algo", "['FP8']"]),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_other_modelopt_schemes_are_refused_by_name(tmp_path, case):
    export(tiny_mamba(), tmp_path, "FP8")
    raw = json.loads((tmp_path / "hf_quant_config.json").read_text())
    edit, fragments = REFUSED[case]
    edit(raw["quantization"])
    (tmp_path / "hf_quant_config.json").write_text(json.dumps(raw))
    with pytest.raises(fastmamba.CheckpointError) as info:
        fastmamba.load(tmp_path, dtype="fp8")
    for f in ["hf_quant_config.json"] + fragments:
        assert f in str(info.value), (f, str(info.value))


def test_a_modelopt_file_without_its_quantization_object_is_refused(tmp_path):
    export(tiny_mamba(), tmp_path, "FP8")
    (tmp_path / "hf_quant_config.json").write_text(json.dumps({"producer": {"name": "modelopt"}}))
    with pytest.raises(fastmamba.CheckpointError, match="hf_quant_config.json: no 'quantization' object"):
        fastmamba.load(tmp_path, dtype="fp8")
