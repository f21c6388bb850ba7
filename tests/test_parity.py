"""The CPU engine against transformers' float32 MambaForCausalLM, and against itself."""

from __future__ import annotations

import pytest
import torch
from conftest import (
    HF_CONFIGS,
    assert_within_transformers_16bit_error,
    save_hf_checkpoint,
    save_original_checkpoint,
)

import fastmamba

F32_TOL = 1e-4  # relative to the largest logit
LOW_TOL = 2e-2  # bf16 / fp16 storage


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    assert torch.isfinite(a).all(), "NaN or inf in the output"
    return ((a - b).abs().max() / b.abs().max()).item()


def random_ids(vocab: int, shape, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", list(HF_CONFIGS))
def test_logits_match_transformers(name, checkpoints, hf_models):
    lm = fastmamba.load(checkpoints[name])
    ids = random_ids(lm.config.vocab_size, (3, 21))
    with torch.no_grad():
        ref = hf_models[name](ids).logits
    out = lm.forward(ids)
    assert out.shape == ref.shape and out.dtype == torch.float32
    assert rel_err(out, ref) < F32_TOL


@pytest.mark.parametrize("name", list(HF_CONFIGS))
def test_teacher_forced_steps_equal_forward(name, checkpoints):
    lm = fastmamba.load(checkpoints[name])
    ids = random_ids(lm.config.vocab_size, (2, 12), seed=1)
    full = lm.forward(ids)
    state = lm.model.new_state(2)
    steps = torch.stack([lm.model.step(ids[:, t], state) for t in range(ids.shape[1])], dim=1)
    assert rel_err(steps, full) < F32_TOL


@pytest.mark.parametrize("split", [1, 2, 3, 4, 7])
def test_prefill_then_steps_equal_forward(split, checkpoints):
    lm = fastmamba.load(checkpoints["kernel3_state8"])
    ids = random_ids(lm.config.vocab_size, (2, 10), seed=2)
    full = lm.forward(ids)
    state = lm.model.new_state(2)
    head = lm.model.prefill(ids[:, :split], state)
    tail = [lm.model.step(ids[:, t], state) for t in range(split, ids.shape[1])]
    assert rel_err(torch.cat([head, torch.stack(tail, 1)], 1), full) < F32_TOL


def greedy_against_transformers(lm, hf_model, prompt_len: int, tokens: int, seed: int):
    """Greedy generation of `tokens` from a random prompt, ours and transformers' (no eos)."""
    prompt = random_ids(lm.config.vocab_size, (1, prompt_len), seed=seed)
    ours = lm.generate(prompt[0].tolist(), max_tokens=tokens, stop_token_ids=[])
    ref = hf_model.generate(prompt, max_new_tokens=tokens, do_sample=False, eos_token_id=None)
    assert ours.token_ids == ref[0, prompt_len:].tolist()
    return ours


@pytest.mark.parametrize("name", ["odd_vocab_tied", "untied_bias_rank"])
def test_greedy_generate_matches_transformers(name, checkpoints, hf_models):
    ours = greedy_against_transformers(fastmamba.load(checkpoints[name]), hf_models[name], 7, 20, seed=3)
    assert ours.finish_reason == "length" and ours.prompt_tokens == 7


def test_repetition_penalty_matches_transformers(checkpoints, hf_models):
    lm = fastmamba.load(checkpoints["odd_vocab_tied"])
    prompt = random_ids(lm.config.vocab_size, (1, 6), seed=4)
    ours = lm.generate(prompt[0].tolist(), max_tokens=24, repetition_penalty=1.8, stop_token_ids=[])
    ref = hf_models["odd_vocab_tied"].generate(
        prompt, max_new_tokens=24, do_sample=False, repetition_penalty=1.8, eos_token_id=None
    )
    plain = lm.generate(prompt[0].tolist(), max_tokens=24, stop_token_ids=[])
    assert ours.token_ids == ref[0, 6:].tolist()
    assert ours.token_ids != plain.token_ids  # the penalty changed the output


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", torch.bfloat16])
@pytest.mark.parametrize("name", ["untied_bias_rank", "kernel3_state8"])
def test_low_precision_storage_within_transformers_own_error(dtype, name, checkpoints):
    """16-bit storage against transformers' float32 model: at most 1.25x the error of
    transformers' own model in that dtype on the same inputs, and finite."""
    path = checkpoints[name]
    lm = fastmamba.load(path, dtype=dtype)
    expected = torch.float16 if dtype == "float16" else torch.bfloat16
    assert lm.model.weights.layers[0].in_proj_w.dtype == expected
    assert lm.model.weights.layers[0].A.dtype == torch.float32  # small parameters stay float32
    ids = random_ids(lm.config.vocab_size, (2, 16), seed=5)
    assert_within_transformers_16bit_error(lm.forward(ids), path, ids, expected)


def test_original_format_matches_transformers(tmp_path):
    from transformers import MambaForCausalLM

    original, hf_dir = save_original_checkpoint(tmp_path, vocab=98, multiple=8)
    lm = fastmamba.load(original)
    assert lm.config.vocab_size == 104  # 98 padded up to a multiple of 8
    hf = MambaForCausalLM.from_pretrained(str(hf_dir)).eval()
    ids = random_ids(98, (2, 9), seed=6)
    with torch.no_grad():
        ref = hf(ids).logits
    assert rel_err(lm.forward(ids), ref) < F32_TOL


def _as_pytorch_bin(folder):
    """Rewrites a saved checkpoint as pytorch_model.bin (the older HF layout)."""
    from safetensors.torch import load_file

    torch.save(load_file(str(folder / "model.safetensors")), folder / "pytorch_model.bin")
    (folder / "model.safetensors").unlink()


@pytest.mark.parametrize("layout", ["sharded_safetensors", "pytorch_model_bin"])
def test_other_hf_layouts_load_the_same_model(layout, tmp_path, checkpoints):
    save_kwargs = dict(max_shard_size="20KB") if layout == "sharded_safetensors" else {}
    folder = save_hf_checkpoint(tmp_path / "m", seed=0, save_kwargs=save_kwargs, **HF_CONFIGS["odd_vocab_tied"])
    if layout == "sharded_safetensors":
        assert (folder / "model.safetensors.index.json").exists()
        assert len(list(folder.glob("model-*.safetensors"))) > 1
    else:
        _as_pytorch_bin(folder)
    ids = random_ids(101, (1, 8), seed=7)
    same = fastmamba.load(checkpoints["odd_vocab_tied"]).forward(ids)
    assert torch.equal(fastmamba.load(folder).forward(ids), same)


def test_bfloat16_state_is_stored_in_bf16_and_stays_close(checkpoints):
    path = checkpoints["untied_bias_rank"]
    f32, bf16 = fastmamba.load(path), fastmamba.load(path, state_dtype="bfloat16")
    state = bf16.model.new_state(2)
    assert state.conv.dtype == state.ssm.dtype == torch.bfloat16
    ids = random_ids(97, (2, 12), seed=8)
    ref_state = f32.model.new_state(2)
    for t in range(12):  # each step rounds the state once on store
        out, ref = bf16.model.step(ids[:, t], state), f32.model.step(ids[:, t], ref_state)
        assert rel_err(out, ref) < LOW_TOL
    assert state.ssm.dtype == torch.bfloat16 and rel_err(state.ssm.float(), ref_state.ssm) < LOW_TOL
    assert not torch.equal(state.ssm.float(), ref_state.ssm)  # it really is rounded
    with pytest.raises(ValueError, match="state_dtype"):
        fastmamba.load(path, state_dtype="int8")
