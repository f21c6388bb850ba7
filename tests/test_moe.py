"""The mixture-of-experts sublayer (core/moe.py) on the reference engine: Granite-4.0-H with
experts against transformers' own GraniteMoeHybrid classes (tiny checkpoints written by
`save_pretrained`: Mamba-2 and attention layers, RoPE and none, one and two experts a token),
routing ties and experts no token picks, and the configs and tensors refused by name."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import assert_within_transformers_16bit_error, relative_error, transformers_logits

import fastmamba
from fastmamba.core import moe
from fastmamba.core.fp8 import Fp8Weight
from fastmamba.core.ops import REFERENCE_OPS
from fastmamba.core.sampling_params import SamplingParams

transformers = pytest.importorskip("transformers")

V = 160


def granite_moe(position="rope", k=2, **kw):
    return transformers.GraniteMoeHybridConfig(
        vocab_size=V, hidden_size=64, num_hidden_layers=3, layer_types=["mamba", "attention", "mamba"],
        num_attention_heads=4, num_key_value_heads=1, shared_intermediate_size=96, intermediate_size=48,
        num_local_experts=4, num_experts_per_tok=k, position_embedding_type=position, embedding_multiplier=6.0,
        logits_scaling=4.0, residual_multiplier=0.3, attention_multiplier=0.05, mamba_n_heads=8, mamba_d_state=16,
        mamba_n_groups=2, mamba_chunk_size=8, **kw)


CASES = {
    "rope_two_a_token": lambda: granite_moe("rope", k=2),
    "nope_one_a_token_tied": lambda: granite_moe("nope", k=1, tie_word_embeddings=True),
}


def save(config, folder, router=None):
    """A random model of `config` saved to `folder` (norms spread, so the multipliers show;
    `router(weight)` edits each layer's router weight in place)."""
    torch.manual_seed(0)
    model = transformers.GraniteMoeHybridForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
            if router is not None and name.endswith("router.weight"):
                router(p)
    model.save_pretrained(folder)
    return model


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    return folder, save(CASES[request.param](), folder)


def ids(batch: int, length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, V, (batch, length), generator=torch.Generator().manual_seed(seed))


def test_the_config_and_the_weights(case):
    folder, hf = case
    lm = fastmamba.load(folder)
    c = lm.config
    assert c.kinds == ("mamba2", "moe", "attention", "moe", "mamba2", "moe")
    assert (c.n_experts, c.expert_size, c.experts_per_token) == (4, 48, hf.config.num_experts_per_tok)
    assert lm.engine == "reference"
    lw = lm.model.weights.layers[1]
    assert lw.in_w.shape == (4, 96, 64) and lw.out_w.shape == (4, 64, 48) and lw.router_w.shape == (4, 64)


def test_float32_logits_equal_transformers(case):
    folder, _ = case
    x = ids(2, 41)
    assert relative_error(fastmamba.load(folder).forward(x), transformers_logits(folder, x)) < 2e-3


def test_greedy_equals_transformers_greedy_and_a_batch_equals_each_alone(case):
    folder, hf = case
    lm = fastmamba.load(folder)
    prompts = [ids(1, n, seed=n)[0].tolist() for n in (5, 23, 9)]
    alone = [lm.generate(p, max_tokens=12, stop_token_ids=[]).token_ids for p in prompts]
    with torch.no_grad():
        want = [hf.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                            pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    assert alone == want
    params = [SamplingParams(max_tokens=10, temperature=0.9 * (k % 2), seed=k, stop_token_ids=[]) for k in range(3)]
    together = lm.generate_batch(prompts, params)
    assert [g.token_ids for g in together] == [lm.generate(p, q).token_ids for p, q in zip(prompts, params)]


def test_decode_steps_continue_the_prefill(case):
    folder, _ = case
    model = fastmamba.load(folder).model
    x = ids(2, 30, seed=3)
    whole = model.forward(x)
    state = model.new_state(2)
    steps = [model.prefill(x[:, :22], state)[:, -1]]
    steps += [model.step(x[:, t], state) for t in range(22, 29)]
    assert relative_error(torch.stack(steps, 1), whole[:, 21:29]) < 1e-5


def test_bfloat16_storage_within_transformers_own_error(case):
    folder, _ = case
    x = ids(2, 33, seed=5)
    assert_within_transformers_16bit_error(fastmamba.load(folder, dtype="bfloat16").forward(x), folder, x, "bfloat16")


def test_fp8_weights_quantize_each_expert(case):
    """dtype='fp8': the stacked experts as e4m3 values with a scale per expert's row."""
    folder, _ = case
    lm = fastmamba.load(folder, dtype="fp8")
    lw = lm.model.weights.layers[1]
    assert isinstance(lw.in_w, Fp8Weight) and lw.in_w.scale.shape == (4, 96)
    x = ids(2, 20, seed=6)
    assert relative_error(lm.forward(x), fastmamba.load(folder).forward(x)) < 0.1


def test_a_token_routes_and_sums_alone_whatever_shares_its_experts(case):
    """The sublayer on 24 tokens: each token's output is its output alone (bitwise), and
    runs repeat bitwise."""
    folder, _ = case
    model = fastmamba.load(folder).model
    c, lw = model.config, model.weights.layers[1]
    u = torch.randn(2, 12, c.d_model, generator=torch.Generator().manual_seed(1))
    together = moe.moe(c, lw, u, REFERENCE_OPS)
    assert torch.equal(together, moe.moe(c, lw, u, REFERENCE_OPS))
    alone = torch.stack([torch.stack([moe.moe(c, lw, u[b, t].view(1, 1, -1), REFERENCE_OPS)[0, 0]
                                      for t in range(12)]) for b in range(2)])
    assert (together - alone).abs().max() <= 1e-6 * together.abs().max()


# -- routing ties, experts no token picks ------------------------------------------------------


@pytest.mark.parametrize("k", [1, 2])
def test_ties_pick_as_transformers_and_unpicked_experts_are_skipped(tmp_path, k):
    """A router of zeros: every logit ties, so each token takes torch.topk's first k experts
    (transformers' order) at equal weights, and the others get no token."""
    folder = tmp_path / "m"
    hf = save(granite_moe("nope", k=k), folder, router=lambda w: w.zero_())
    lm = fastmamba.load(folder)
    c, lw = lm.config, lm.model.weights.layers[1]
    experts, weights = moe.route(c, lw, torch.randn(7, c.d_model), REFERENCE_OPS)
    assert torch.equal(experts, torch.zeros(7, 4).topk(k, dim=-1).indices)
    assert len(experts.unique()) == k < 4 and torch.equal(weights, torch.full((7, k), 1.0 / k))
    x = ids(2, 25, seed=2)
    assert relative_error(lm.forward(x), transformers_logits(folder, x)) < 2e-3
    p = ids(1, 9, seed=4)[0].tolist()
    with torch.no_grad():
        want = hf.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert lm.generate(p, max_tokens=8, stop_token_ids=[]).token_ids == want[0, len(p):].tolist()


def every_expert(c, lw, x):
    """The routed sum computed by running every expert on every token (x (N, d)): the oracle."""
    logits = x @ lw.router_w.T  # (N, E)
    top, picked = logits.topk(c.experts_per_token, dim=-1)
    gates = torch.zeros_like(logits).scatter(1, picked, torch.softmax(top, dim=-1))  # (N, E)
    out = torch.zeros_like(x)
    for e in range(c.n_experts):
        gate, up = (x @ lw.in_w[e].float().T).split(c.expert_size, dim=-1)
        out += gates[:, e : e + 1] * ((torch.nn.functional.silu(gate) * up) @ lw.out_w[e].float().T)
    return out


def test_experts_that_no_token_picks_are_skipped(case):
    """One token (as a batch-1 decode step has): k experts run, the others get no token; the
    sum is the all-experts oracle's; so is a batch's."""
    folder, _ = case
    model = fastmamba.load(folder).model
    c, lw = model.config, model.weights.layers[3]
    lw = moe.MoEWeights(lw.norm_w, lw.router_w, lw.in_w, lw.out_w)  # (the routed part alone)
    for n in (1, 3, 17):
        x = torch.randn(n, c.d_model, generator=torch.Generator().manual_seed(n))
        picked, _ = moe.route(c, lw, x, REFERENCE_OPS)
        if n == 1:
            assert len(picked.unique()) == c.experts_per_token < c.n_experts
        got = moe.moe(c, lw, x.view(1, n, -1), REFERENCE_OPS)[0]
        assert relative_error(got, every_expert(c, lw, x)) < 1e-5


# -- refused by name ---------------------------------------------------------------------------


def edited(folder, tmp_path, change) -> str:
    out = tmp_path / "edited"
    out.mkdir(parents=True)
    for f in folder.iterdir():
        (out / f.name).write_bytes(f.read_bytes())
    config = json.loads((out / "config.json").read_text())
    change(config)
    (out / "config.json").write_text(json.dumps(config))
    return str(out)


def refused(path: str, *words: str) -> None:
    with pytest.raises(fastmamba.CheckpointError) as e:
        fastmamba.load(path)
    for w in words:
        assert w in str(e.value), str(e.value)


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    folder = tmp_path_factory.mktemp("small")
    save(granite_moe("nope", k=2), folder)
    return folder


@pytest.mark.parametrize("change,words", [
    (lambda c: c.update(norm_topk_prob=False), ("'norm_topk_prob'", "renormalized")),
    (lambda c: c.update(scoring_func="sigmoid"), ("'scoring_func'", "sigmoid")),
    (lambda c: c.update(routed_scaling_factor=2.5), ("'routed_scaling_factor'",)),
    (lambda c: c.update(n_group=2, topk_group=1), ("'n_group'",)),
    (lambda c: c.update(num_experts_per_tok=5), ("'num_experts_per_tok'", "5")),
    (lambda c: c.update(num_local_experts=-1), ("'num_local_experts'",)),
    (lambda c: c.update(intermediate_size=40), ("block_sparse_moe.input_linear.weight", "has shape")),
    (lambda c: c.update(num_local_experts=3), ("block_sparse_moe.", "has shape")),
])
def test_routing_and_sizes_that_change_the_math_are_refused_by_name(small, tmp_path, change, words):
    refused(edited(small, tmp_path, change), *words)


def test_the_training_keys_are_accepted(small, tmp_path):
    path = edited(small, tmp_path, lambda c: c.update(output_router_logits=True, router_aux_loss_coef=0.02,
                                                      router_jitter_noise=0.1, norm_topk_prob=True))
    assert fastmamba.load(path).config.n_experts == 4


@pytest.mark.parametrize("name,shape", [("block_sparse_moe.output_linear.weight", (4, 64, 40)),
                                        ("block_sparse_moe.input_linear.weight", (3, 96, 64)),
                                        ("block_sparse_moe.router.layer.weight", (4, 32))])
def test_an_expert_tensor_of_the_wrong_shape_is_named(small, tmp_path, name, shape):
    from safetensors.torch import load_file, save_file

    out = tmp_path / "m"
    out.mkdir()
    for f in small.iterdir():
        (out / f.name).write_bytes(f.read_bytes())
    tensors = load_file(str(out / "model.safetensors"))
    tensors[f"model.layers.2.{name}"] = torch.zeros(shape)
    save_file(tensors, str(out / "model.safetensors"))
    refused(str(out), f"'model.layers.2.{name}' has shape {shape}")


@pytest.mark.gpu
def test_on_the_gpu_the_reference_engine_runs_it_as_the_cpu_does(small):
    """Until the GPU engine's MoE kernel exists, a model with experts runs on the reference
    engine on the GPU too (pure PyTorch, no CUDA graphs), and engine='triton' is refused by name."""
    with pytest.raises(ValueError, match="moe sublayers"):
        fastmamba.load(small, device="cuda", engine="triton")
    cpu, gpu = fastmamba.load(small), fastmamba.load(small, device="cuda")
    assert gpu.engine == "reference"
    x = ids(2, 25)
    assert relative_error(gpu.forward(x.cuda()), cpu.forward(x)) < 1e-4
    prompts = [ids(1, n, seed=n)[0].tolist() for n in (5, 23, 9)]
    want = [cpu.generate(p, max_tokens=8, stop_token_ids=[]).token_ids for p in prompts]
    assert [g.token_ids for g in gpu.generate_batch(prompts, SamplingParams(max_tokens=8, stop_token_ids=[]))] == want
