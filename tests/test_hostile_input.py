"""Hostile and odd input: every case ends in one clear error naming the culprit."""

from __future__ import annotations

import json
import os
import shutil
import threading
import time

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from test_loader import edit_config, load_error

import fastmamba


@pytest.fixture()
def ckpt(tmp_path, text_checkpoint):
    dst = tmp_path / "ckpt"
    shutil.copytree(text_checkpoint, dst)
    return dst


@pytest.fixture(scope="module")
def lm(text_checkpoint):
    return fastmamba.load(text_checkpoint)


# -- the loader ------------------------------------------------------------------------------


@pytest.mark.parametrize("layers", [10_000_000, 10**9])
def test_a_huge_layer_count_fails_at_once(ckpt, layers):
    edit_config(ckpt, lambda c: c.update(num_hidden_layers=layers))
    t0 = time.perf_counter()
    load_error(ckpt, "model.safetensors", "missing tensor 'backbone.layers.2.norm.weight'", f"{layers} layers")
    assert time.perf_counter() - t0 < 5


def test_huge_sizes_fail_against_the_header(ckpt):
    edit_config(ckpt, lambda c: c.update(hidden_size=10**12, vocab_size=10**12))
    load_error(ckpt, "model.safetensors", "config.json implies")


def sharded(folder, weight_map):
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


@pytest.mark.parametrize("shard", ["../outside.safetensors", "/etc/passwd", "sub/../../x.safetensors"])
def test_a_shard_outside_the_folder_is_refused(ckpt, shard):
    shutil.copy(ckpt / "model.safetensors", ckpt.parent / "outside.safetensors")
    sharded(ckpt, {"backbone.norm_f.weight": shard})
    load_error(ckpt, shard, "outside the checkpoint folder")


def test_a_symlink_out_of_the_folder_is_refused(ckpt):
    outside = ckpt.parent / "elsewhere.safetensors"
    (ckpt / "model.safetensors").rename(outside)
    (ckpt / "model.safetensors").symlink_to(outside)
    load_error(ckpt, "model.safetensors", "outside the checkpoint folder")


def test_a_symlink_inside_the_folder_loads(ckpt):
    (ckpt / "model.safetensors").rename(ckpt / "weights.data")
    (ckpt / "model.safetensors").symlink_to("weights.data")
    assert fastmamba.load(ckpt).config.n_layer == 2


def test_a_weight_map_value_that_is_not_a_string(ckpt):
    sharded(ckpt, {"backbone.norm_f.weight": 7})
    load_error(ckpt, "model.safetensors.index.json", "weight_map['backbone.norm_f.weight']", "7")


def test_config_that_is_a_folder_or_a_symlink_loop(ckpt):
    (ckpt / "config.json").unlink()
    (ckpt / "config.json").mkdir()
    load_error(ckpt, "config.json")
    (ckpt / "config.json").rmdir()
    (ckpt / "config.json").symlink_to("config.json")
    load_error(ckpt, "config.json")


def test_pickled_code_is_refused_without_a_warning(ckpt, recwarn):
    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    (ckpt / "model.safetensors").unlink()
    torch.save({"x": Evil()}, ckpt / "pytorch_model.bin")
    load_error(ckpt, "pytorch_model.bin", "cannot read", "never unpickled")
    assert not [w for w in recwarn if "weights_only" in str(w.message)]


def test_eos_outside_the_vocabulary(ckpt):
    edit_config(ckpt, lambda c: c.update(eos_token_id=10**6))
    load_error(ckpt, "config.json", "eos_token_id", "outside the vocabulary")


def test_a_tokenizer_larger_than_the_model(ckpt):
    tensors = load_file(str(ckpt / "model.safetensors"))
    V = tensors["backbone.embeddings.weight"].shape[0]
    tensors["backbone.embeddings.weight"] = tensors["backbone.embeddings.weight"][: V - 10].clone()
    save_file(tensors, str(ckpt / "model.safetensors"))
    edit_config(ckpt, lambda c: c.update(vocab_size=V - 10))
    load_error(ckpt, "tokenizer.json", f"{V} tokens", f"model's {V - 10}")


def test_non_finite_config_number(ckpt):
    (ckpt / "config.json").write_text((ckpt / "config.json").read_text().replace('"layer_norm_epsilon": 1e-05', '"layer_norm_epsilon": Infinity'))
    load_error(ckpt, "config.json", "layer_norm_epsilon")


@pytest.mark.parametrize("name", ["config.json", "model.safetensors", "tokenizer.json", "model.safetensors.index.json"])
def test_a_fifo_in_the_folder_is_named_not_waited_on(ckpt, name):
    """Opening a FIFO for reading waits for a writer: load waited forever."""
    (ckpt / name).unlink(missing_ok=True)
    os.mkfifo(ckpt / name)
    errors = []

    def load():
        try:
            fastmamba.load(ckpt)
        except fastmamba.CheckpointError as e:
            errors.append(str(e))

    t = threading.Thread(target=load, daemon=True)  # (daemon: a thread still waiting on the FIFO ends with the tests)
    t.start()
    t.join(60)
    assert not t.is_alive(), "load waits on the FIFO"
    assert len(errors) == 1 and name in errors[0] and "a FIFO, not a regular file" in errors[0], errors


def test_a_deeply_nested_shard_index(ckpt):
    (ckpt / "model.safetensors.index.json").write_text("[" * 100_000 + "]" * 100_000)
    load_error(ckpt, "model.safetensors.index.json", "not a valid shard index", "RecursionError")


def test_config_numbers_past_float32(ckpt):
    """(1e39 passed as a finite positive number, and became inf in the float32 norms: every logit 0)"""
    edit_config(ckpt, lambda c: c.update(layer_norm_epsilon=1e39))
    load_error(ckpt, "config.json", "'layer_norm_epsilon'", "float32's range")


def test_float64_values_past_float32(ckpt):
    tensors = {k: v.double() for k, v in load_file(str(ckpt / "model.safetensors")).items()}
    tensors["backbone.layers.0.mixer.out_proj.weight"][0, 0] = 1e300
    save_file(tensors, str(ckpt / "model.safetensors"))
    load_error(ckpt, "model.safetensors", "'backbone.layers.0.mixer.out_proj.weight'", "1e+300", "float32's range")


def test_a_broken_tokenizer_link_is_named(ckpt):
    """(it was taken for no tokenizer: 'has no tokenizer.json' later, for a file that is there)"""
    (ckpt / "tokenizer.json").rename(ckpt / "moved.json")
    (ckpt / "tokenizer.json").symlink_to("gone.json")
    load_error(ckpt, "tokenizer.json")


def test_tokenizer_ids_past_the_vocabulary(ckpt):
    """A token's id past vocab_size, the count within it: the prompt was blamed at encode time."""
    V = json.loads((ckpt / "config.json").read_text())["vocab_size"]
    tok = json.loads((ckpt / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    last = max(vocab, key=vocab.get)
    vocab[last] = V + 100
    (ckpt / "tokenizer.json").write_text(json.dumps(tok))
    load_error(ckpt, "tokenizer.json", f"ids up to {V + 100}", f"model's {V}")


def test_an_empty_model_path():
    with pytest.raises(ValueError, match="empty"):
        fastmamba.load("")


# -- prompts and ids -------------------------------------------------------------------------


def test_numpy_and_tensor_ids_are_token_ids(lm):
    ids = lm.encode("To be")
    expected = lm.generate(ids, max_tokens=4).token_ids
    assert lm.generate(np.array(ids, dtype=np.int64), max_tokens=4).token_ids == expected
    assert lm.generate(np.array(ids, dtype=np.uint16), max_tokens=4).token_ids == expected
    assert lm.generate(torch.tensor(ids), max_tokens=4).token_ids == expected
    assert lm.generate([np.int64(i) for i in ids], max_tokens=4).token_ids == expected


@pytest.mark.parametrize(
    "prompt, fragment",
    [
        (b"To be", "bytes"),
        (1.5, "float"),
        ([1, 2.5], "not an integer token id"),
        (torch.tensor([[1, 2]]), "1-D"),
        (torch.tensor([1.0, 2.0]), "1-D integers"),
        (np.array([1.0]), "1-D integers"),
        ("To be \udcff", "lone surrogate"),
        ([], "empty"),
        ([10**6], "outside the vocabulary"),
    ],
)
def test_bad_prompts(lm, prompt, fragment):
    with pytest.raises(ValueError, match=fragment):
        lm.generate(prompt, max_tokens=2)


@pytest.mark.parametrize("shape", [(1, 0), (0, 3)])
def test_forward_of_nothing(lm, shape):
    with pytest.raises(ValueError, match="at least one"):
        lm.forward(torch.zeros(shape, dtype=torch.int64))


@pytest.mark.parametrize("field, value", [("temperature", 1e39), ("repetition_penalty", 1e39), ("temperature", float("nan"))])
def test_values_beyond_float32(field, value):
    with pytest.raises(ValueError, match=field):
        fastmamba.SamplingParams(**{field: value})


def test_params_as_a_dict(lm):
    assert lm.generate("To be", {"max_tokens": 2}).token_ids == lm.generate("To be", max_tokens=2).token_ids
    with pytest.raises(TypeError, match="max_tokns"):
        lm.generate("To be", {"max_tokns": 2})
    with pytest.raises(TypeError, match="params must be"):
        lm.generate("To be", 5)


def test_generate_batch_of_nothing(lm):
    for bad in (None, [], "a"):
        with pytest.raises(ValueError, match="prompts must be a non-empty list"):
            lm.generate_batch(bad)


def test_stop_ids_outside_the_vocabulary(lm):
    with pytest.raises(ValueError, match="stop_token_ids.*outside the vocabulary"):
        lm.generate("To be", max_tokens=2, stop_token_ids=[10**6])


@pytest.mark.parametrize("seed", [2**32, -1])
def test_seed_range(seed):
    with pytest.raises(ValueError, match="seed"):
        fastmamba.SamplingParams(seed=seed)
    assert fastmamba.SamplingParams(seed=2**32 - 1).seed == 2**32 - 1


# -- weights files that are not what they seem -----------------------------------------------


def test_a_weights_file_that_is_a_folder(ckpt):
    (ckpt / "model.safetensors").unlink()
    (ckpt / "model.safetensors").mkdir()
    load_error(ckpt, "model.safetensors", "is a folder")


def test_a_weights_symlink_loop(ckpt):
    (ckpt / "model.safetensors").unlink()
    os.symlink("model.safetensors", ckpt / "model.safetensors")
    load_error(ckpt, "model.safetensors", "symlink loop")


def test_an_unreadable_weights_file(ckpt, monkeypatch):
    # (as root every file is readable: the refusal the operating system gives others, simulated)
    import builtins

    target, real_open = str(ckpt / "model.safetensors"), builtins.open

    def refusing_open(path, *args, **kw):
        if str(path) == target:
            raise PermissionError(13, "Permission denied", target)
        return real_open(path, *args, **kw)

    monkeypatch.setattr(builtins, "open", refusing_open)
    load_error(ckpt, "model.safetensors", "permission denied")


def test_weights_that_overflow_name_the_layer(ckpt):
    tensors = load_file(ckpt / "model.safetensors")
    tensors["backbone.layers.1.mixer.in_proj.weight"].fill_(1e38)
    save_file(tensors, ckpt / "model.safetensors")
    lm = fastmamba.load(ckpt)  # finite weights: the load itself is fine
    for call in (lambda: lm.generate("To be", max_tokens=3), lambda: lm.forward(torch.tensor([[1, 2, 3]])),
                 lambda: list(lm.stream([5, 6], max_tokens=2))):
        with pytest.raises(fastmamba.NonFiniteError, match=r"layer 1 \(backbone\.layers\.1\)"):
            call()


def test_check_finite_names_the_layer_behind_nonfinite_logits(lm):
    """The GPU engine's path: logits checked once, the layer found by a checked rerun."""
    model = lm.model
    model.check_finite(torch.zeros(1, 5), [[1, 2, 3]])  # finite: nothing to say
    w = model.weights.layers[0].out_proj_w
    saved = w.clone()
    try:
        w.fill_(float("inf"))
        with pytest.raises(fastmamba.NonFiniteError, match=r"layer 0 \("):
            model.check_finite(torch.full((1, 5), float("nan")), [[1, 2, 3]])
    finally:
        w.copy_(saved)
    with pytest.raises(fastmamba.NonFiniteError, match="lm_head"):  # the layers are fine, the logits not
        model.check_finite(torch.full((1, 5), float("nan")), [[1, 2, 3]])


# -- small API frictions ---------------------------------------------------------------------


def test_numpy_scalars_are_numbers(lm):
    p = fastmamba.SamplingParams(max_tokens=np.int64(3), temperature=np.float32(0.5), top_k=np.int32(5),
                                 seed=np.uint32(7), stop_token_ids=np.array([0]))
    assert (p.max_tokens, p.top_k, p.seed, p.stop_token_ids) == (3, 5, 7, (0,))
    assert type(p.max_tokens) is int and type(p.temperature) is float and p.temperature == 0.5
    assert lm.generate("To be", p).token_ids == lm.generate("To be", max_tokens=3, temperature=0.5, top_k=5, seed=7).token_ids
    with pytest.raises(ValueError, match="max_tokens"):
        fastmamba.SamplingParams(max_tokens=np.bool_(True))


@pytest.mark.parametrize("bad", [123, 1.5, ["a"], b"dir"])
def test_load_names_the_model_argument(bad):
    with pytest.raises(ValueError, match="^model must be"):
        fastmamba.load(bad)


def test_load_bounds_threads():
    with pytest.raises(ValueError, match="threads"):
        fastmamba.load(threads=(os.cpu_count() or 1) + 1)


@pytest.mark.gpu
def test_weights_that_overflow_name_the_layer_on_the_gpu_engine(ckpt):
    """The GPU engine checks each prompt's logits on the device and, when they are not
    finite, names the layer by a checked rerun."""
    tensors = load_file(ckpt / "model.safetensors")
    tensors["backbone.layers.1.mixer.in_proj.weight"].fill_(1e38)
    save_file(tensors, ckpt / "model.safetensors")
    lm = fastmamba.load(ckpt, device="cuda")
    assert lm.engine == "triton"
    with pytest.raises(fastmamba.NonFiniteError, match=r"layer 1 \(backbone\.layers\.1\)"):
        lm.generate("To be", max_tokens=3)
