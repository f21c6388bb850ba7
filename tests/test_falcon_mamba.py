"""Falcon-Mamba (transformers' FalconMambaForCausalLM): Mamba-1 with x_proj's dt_r, B and C
RMS-normalised. Against transformers' float32 model on the CPU, and every engine's kernels
against the reference (the interpreter on the CPU, compiled on a GPU)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from conftest import FALCON_CONFIGS
from test_loader import edit_config, load_error
from test_parity import F32_TOL, greedy_against_transformers, random_ids, rel_err

import fastmamba

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module")
def hf_falcon(falcon_checkpoints):
    from transformers import FalconMambaForCausalLM

    return {n: FalconMambaForCausalLM.from_pretrained(str(p)).eval() for n, p in falcon_checkpoints.items()}


def test_config_reads_the_norm(falcon_checkpoints):
    for name, cfg in FALCON_CONFIGS.items():
        c = fastmamba.load(falcon_checkpoints[name]).config
        assert c.dbc_norm_eps == cfg["mixer_rms_eps"]
        assert c.tie_embeddings == cfg.get("tie_word_embeddings", True)
    assert fastmamba.MambaConfig(d_model=16, n_layer=1, vocab_size=8).dbc_norm_eps is None  # plain Mamba


@pytest.mark.parametrize("name", list(FALCON_CONFIGS))
def test_logits_match_transformers(name, falcon_checkpoints, hf_falcon):
    lm = fastmamba.load(falcon_checkpoints[name])
    ids = random_ids(lm.config.vocab_size, (3, 19), seed=1)
    with torch.no_grad():
        ref = hf_falcon[name](ids).logits
    assert rel_err(lm.forward(ids), ref) < F32_TOL
    # without the norm the logits are far off: the test sees it
    plain = fastmamba.Mamba(dataclasses.replace(lm.config, dbc_norm_eps=None), lm.model.weights, lm.model.ops)
    assert rel_err(plain.forward(ids), ref) > 100 * F32_TOL


@pytest.mark.parametrize("name", ["falcon_tied", "falcon_untied_rank"])
def test_greedy_generate_matches_transformers(name, falcon_checkpoints, hf_falcon):
    greedy_against_transformers(fastmamba.load(falcon_checkpoints[name]), hf_falcon[name], 6, 16, seed=2)


def test_steps_equal_forward(falcon_checkpoints):
    lm = fastmamba.load(falcon_checkpoints["falcon_untied_rank"])
    ids = random_ids(lm.config.vocab_size, (2, 9), seed=3)
    state = lm.model.new_state(2)
    steps = torch.stack([lm.model.step(ids[:, t], state) for t in range(ids.shape[1])], dim=1)
    assert rel_err(steps, lm.forward(ids)) < F32_TOL


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_16bit_storage_within_transformers_own_error(dtype, falcon_checkpoints, hf_falcon):
    """fastmamba's 16-bit logits against transformers' float32 ones: at most 1.25x the error
    of transformers' own model in that dtype, on the same inputs."""
    from transformers import FalconMambaForCausalLM

    path = falcon_checkpoints["falcon_untied_rank"]
    ids = random_ids(97, (2, 16), seed=4)
    with torch.no_grad():
        ref = hf_falcon["falcon_untied_rank"](ids).logits
        hf16 = FalconMambaForCausalLM.from_pretrained(str(path), dtype=getattr(torch, dtype)).eval()(ids).logits.float()
    ours = fastmamba.load(path, dtype=dtype).forward(ids)
    assert rel_err(ours, ref) <= 1.25 * rel_err(hf16, ref)


def test_config_of_an_unsupported_architecture_says_what_is(falcon_checkpoints, tmp_path):
    import shutil

    ckpt = tmp_path / "m"
    shutil.copytree(falcon_checkpoints["falcon_tied"], ckpt)
    edit_config(ckpt, lambda c: c.update(model_type="zamba2"))
    load_error(ckpt, "config.json", "'zamba2'", "falcon_mamba", "mamba2")


def test_intermediate_size_wins_over_expand(falcon_checkpoints, tmp_path):
    import shutil

    ckpt = tmp_path / "m"
    shutil.copytree(falcon_checkpoints["falcon_tied"], ckpt)
    edit_config(ckpt, lambda c: c.update(expand=16))  # as published configs may say
    assert fastmamba.load(ckpt).config.d_inner == json.loads((ckpt / "config.json").read_text())["intermediate_size"]


def test_untied_head_is_required_when_untied(falcon_checkpoints, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    ckpt = tmp_path / "m"
    shutil.copytree(falcon_checkpoints["falcon_untied_rank"], ckpt)
    tensors = load_file(str(ckpt / "model.safetensors"))
    tensors.pop("lm_head.weight")
    save_file(tensors, str(ckpt / "model.safetensors"))
    load_error(ckpt, "lm_head.weight", "missing")


# -- the kernels (interpreter on the CPU, compiled with CUDA) ---------------------------------

TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 2e-2}


@pytest.mark.parametrize("name,dtype,batch,step_kind", [
    ("falcon_untied_rank", "float32", 2, "one-row"),
    ("falcon_wide_state8", "bfloat16", 3, "one-row"),
    ("falcon_untied_rank", "bfloat16", 9, "triton products"),
    ("falcon_tied", "float32", 5, "cublas"),
])
def test_decode_steps_equal_the_reference(falcon_checkpoints, name, dtype, batch, step_kind):
    pytest.importorskip("triton")
    from fastmamba.engine.decode_step import make_decode_step
    from fastmamba.engine.plan import ALL, NONE, DecodePlan
    from fastmamba.kernels.decode_gemm import GemmDecodeStep

    model = fastmamba.load(falcon_checkpoints[name], device=DEVICE, dtype=dtype).model
    if step_kind == "one-row":
        step = make_decode_step(model, batch, plan=DecodePlan("one-row"))
    else:
        step = GemmDecodeStep(model, batch, DecodePlan("products", NONE if step_kind == "triton products" else ALL))
    state = model.new_state(batch)
    state.ssm.copy_(torch.randn(state.ssm.shape, generator=torch.Generator().manual_seed(5)).to(DEVICE))
    ref_state = fastmamba.MambaState(state.conv.clone(), state.ssm.clone())
    tol = TOL[model.weights.embedding.dtype]
    g = torch.Generator().manual_seed(6)
    for _ in range(3):
        tokens = torch.randint(0, model.config.vocab_size, (batch,), generator=g).to(DEVICE)
        assert rel_err(step(tokens, state), model.step(tokens, ref_state)) < tol
    assert rel_err(state.ssm, ref_state.ssm) < tol


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gpu_engine_generates_the_cpu_tokens(dtype, falcon_checkpoints):
    """The whole GPU engine (graph prefill, decode graphs) on a Falcon-Mamba checkpoint."""
    path = falcon_checkpoints["falcon_untied_rank"]
    cpu, gpu = fastmamba.load(path, dtype=dtype), fastmamba.load(path, device="cuda", dtype=dtype)
    ids = random_ids(97, (2, 40), seed=7)
    tol = 1e-3 if dtype == "float32" else 2e-2
    assert rel_err(gpu.forward(ids).cpu(), cpu.forward(ids)) < tol
    prompt = ids[0, :12].tolist()
    if dtype == "float32":
        assert gpu.generate(prompt, max_tokens=24, stop_token_ids=[]).token_ids == cpu.generate(
            prompt, max_tokens=24, stop_token_ids=[]).token_ids
