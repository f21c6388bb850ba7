"""Every way a checkpoint can be bad gives one CheckpointError naming the file and tensor/key."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from conftest import save_original_checkpoint
from safetensors.torch import load_file, save_file

import fastmamba


@pytest.fixture()
def ckpt(tmp_path, checkpoints):
    """A writable copy of a valid checkpoint (untied head, biases on)."""
    dst = tmp_path / "ckpt"
    shutil.copytree(checkpoints["untied_bias_rank"], dst)
    return dst


def edit_tensors(folder, change):
    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    change(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


def edit_config(folder, change):
    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    change(cfg)
    path.write_text(json.dumps(cfg))


def load_error(folder, *fragments) -> str:
    with pytest.raises(fastmamba.CheckpointError) as info:
        fastmamba.load(folder)
    message = str(info.value)
    for f in fragments:
        assert f in message, f"{f!r} not in {message!r}"
    assert "\n" not in message
    return message


def test_checkpoint_error_is_a_value_error():
    assert issubclass(fastmamba.CheckpointError, ValueError)


def test_missing_tensor(ckpt):
    edit_tensors(ckpt, lambda t: t.pop("backbone.layers.1.mixer.x_proj.weight"))
    load_error(ckpt, "model.safetensors", "backbone.layers.1.mixer.x_proj.weight", "missing")


def test_unexpected_tensor(ckpt):
    edit_tensors(ckpt, lambda t: t.update({"backbone.layers.0.mixer.extra": torch.zeros(3)}))
    load_error(ckpt, "model.safetensors", "backbone.layers.0.mixer.extra", "unexpected")


def test_unexpected_tensor_from_an_extra_layer(ckpt):
    edit_config(ckpt, lambda c: c.update(num_hidden_layers=1))
    load_error(ckpt, "model.safetensors", "backbone.layers.1.", "unexpected")


def test_wrong_shape(ckpt):
    edit_tensors(ckpt, lambda t: t.update({"backbone.layers.0.mixer.A_log": torch.zeros(32, 15)}))
    load_error(ckpt, "model.safetensors", "backbone.layers.0.mixer.A_log", "(32, 15)", "(32, 16)")


def test_config_that_disagrees_with_the_weights(ckpt):
    edit_config(ckpt, lambda c: c.update(state_size=8))
    load_error(ckpt, "model.safetensors", "x_proj.weight", "config.json implies")


def test_float8_weights_are_refused_by_name(ckpt):
    edit_tensors(ckpt, lambda t: t.update({"backbone.layers.0.mixer.in_proj.weight":
                                            t["backbone.layers.0.mixer.in_proj.weight"].to(torch.float8_e4m3fn)}))
    load_error(ckpt, "model.safetensors", "backbone.layers.0.mixer.in_proj.weight", "float8", "FP8")


def test_integer_weights_are_refused_by_name(ckpt):
    edit_tensors(ckpt, lambda t: t.update({"backbone.layers.1.mixer.D": t["backbone.layers.1.mixer.D"].to(torch.int64)}))
    load_error(ckpt, "model.safetensors", "backbone.layers.1.mixer.D", "is i64, not floating point")


def test_a_quantized_checkpoints_config_is_refused_by_name(ckpt):
    """(FP8 checkpoints in the compressed-tensors format are read: tests/test_fp8.py.)"""
    edit_config(ckpt, lambda c: c.update(quantization_config={"quant_method": "gptq", "bits": 4}))
    load_error(ckpt, "config.json", "quantization_config.quant_method", "gptq")
    edit_config(ckpt, lambda c: c.update(quantization_config={"quant_method": "compressed-tensors"}))
    load_error(ckpt, "config.json", "quantization_config.format", "None")


def test_a_mamba2_config_over_mamba1_weights(ckpt):
    """Every field left to Mamba-2's defaults: the error says they are defaults; set so that
    the config is consistent: the missing tensors come with the weights' own kind."""
    edit_config(ckpt, lambda c: c.update(model_type="mamba2"))
    load_error(ckpt, "config.json", "head_dim 64", "defaults, not in config.json: head_dim")
    edit_config(ckpt, lambda c: c.update(head_dim=16))
    load_error(ckpt, "config.json", "n_groups 8", "2 heads", "defaults, not in config.json: n_groups")
    edit_config(ckpt, lambda c: c.update(n_groups=1))
    load_error(ckpt, "model.safetensors", "missing tensor", "the weights are a Mamba-1 model's")


def test_non_finite_values(ckpt):
    def poison(t):
        t["backbone.layers.1.mixer.D"][3] = float("nan")

    edit_tensors(ckpt, poison)
    load_error(ckpt, "model.safetensors", "backbone.layers.1.mixer.D", "NaN")


def test_values_beyond_float16_are_refused_only_for_float16(ckpt):
    def big(t):
        t["backbone.layers.0.mixer.out_proj.weight"][0, 0] = 1e6

    edit_tensors(ckpt, big)
    with pytest.raises(fastmamba.CheckpointError, match="out_proj.weight.*float16") as info:
        fastmamba.load(ckpt, dtype="float16")
    assert "model.safetensors" in str(info.value)
    assert torch.isfinite(fastmamba.load(ckpt, dtype="bfloat16").forward(torch.tensor([[1, 2]]))).all()


def test_truncated_safetensors(ckpt):
    path = ckpt / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    load_error(ckpt, "model.safetensors", "cannot read")


def test_corrupt_pytorch_bin(ckpt):
    (ckpt / "model.safetensors").unlink()
    (ckpt / "pytorch_model.bin").write_bytes(b"this is not a zip file at all" * 10)
    message = load_error(ckpt, "pytorch_model.bin", "cannot read", "not a checkpoint torch.load reads")
    assert "pickled objects" not in message  # (torch's refusal of any bad pickle was taken for objects)



def test_bad_json_config(ckpt):
    (ckpt / "config.json").write_text("{ not json")
    load_error(ckpt, "config.json", "not valid JSON")


def test_incomplete_config(ckpt):
    edit_config(ckpt, lambda c: c.pop("num_hidden_layers"))
    load_error(ckpt, "config.json", "num_hidden_layers")


def test_config_value_of_the_wrong_type(ckpt):
    edit_config(ckpt, lambda c: c.update(hidden_size="sixteen"))
    load_error(ckpt, "config.json", "hidden_size")


def test_config_of_another_architecture(ckpt):
    edit_config(ckpt, lambda c: c.update(model_type="llama"))
    load_error(ckpt, "config.json", "model_type")


def test_config_of_no_known_format(ckpt):
    (ckpt / "config.json").write_text(json.dumps({"n_embd": 16}))
    load_error(ckpt, "config.json", "hidden_size", "d_model")


def test_missing_config(ckpt):
    (ckpt / "config.json").unlink()
    load_error(ckpt, "config.json", "not found")


def test_missing_weights(ckpt):
    (ckpt / "model.safetensors").unlink()
    load_error(ckpt, str(ckpt), "no weights file")


def test_nonexistent_path(tmp_path):
    load_error(tmp_path / "nowhere", "nowhere", "no such")


def test_path_that_is_a_file(ckpt):
    load_error(ckpt / "config.json", "config.json", "folder")


def test_shard_index_naming_a_missing_shard(ckpt):
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "model-00002.safetensors"}}))
    load_error(ckpt, "model.safetensors.index.json", "model-00002.safetensors")


def test_tied_checkpoint_whose_head_differs(tmp_path):
    original, _ = save_original_checkpoint(tmp_path)
    sd = torch.load(original / "pytorch_model.bin", weights_only=True)
    sd["lm_head.weight"] = sd["lm_head.weight"] + 1
    torch.save(sd, original / "pytorch_model.bin")
    load_error(original, "pytorch_model.bin", "lm_head.weight", "tie")


def test_bad_tokenizer_file(ckpt):
    (ckpt / "tokenizer.json").write_text("{}")
    load_error(ckpt, "tokenizer.json")


def test_bad_dtype_and_device(ckpt):
    with pytest.raises(ValueError, match="dtype"):
        fastmamba.load(ckpt, dtype="int8")
    with pytest.raises(ValueError, match="device"):
        fastmamba.load(ckpt, device="tpu")


def test_a_failed_load_does_not_change_a_loaded_model(ckpt):
    lm = fastmamba.load(ckpt)
    before = lm.forward(torch.tensor([[1, 2, 3]]))
    edit_tensors(ckpt, lambda t: t.pop("backbone.norm_f.weight"))
    load_error(ckpt, "backbone.norm_f.weight")
    assert torch.equal(lm.forward(torch.tensor([[1, 2, 3]])), before)


def test_a_conv_activation_other_than_silu_is_refused_by_name(ckpt):
    """(transformers applies Mamba's `hidden_act` to the conv's output; the kernels apply SiLU)"""
    edit_config(ckpt, lambda c: c.update(hidden_act="gelu"))
    load_error(ckpt, "config.json", "'hidden_act' is 'gelu'", "only 'silu'")


@pytest.mark.parametrize("key,value", [("d_intermediate", 128), ("attn_layer_idx", [1])])
def test_mamba_ssms_own_hybrids_are_refused_by_the_key(tmp_path, key, value):
    """(mamba_ssm's config of MLPs after its mixers, or attention at some layers: refused by the
    key whether the weights hold those sublayers or not)"""
    original, _ = save_original_checkpoint(tmp_path)
    edit_config(original, lambda c: c.update({key: value}))
    load_error(original, "config.json", f"'{key}'", "not supported")
