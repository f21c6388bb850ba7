"""Jamba against transformers' own JambaForCausalLM, on the reference engine and on the GPU
one: tiny checkpoints written by `save_pretrained` (Mamba-1 mixers with their dt, B and C
norms, attention without positions, GQA, experts one and two a token and a dense model of one
expert, tied and untied heads), routing ties and experts no token picks, and the configs and
tensors refused by name."""

from __future__ import annotations

import pytest
import torch
from conftest import relative_error

# (the dense hybrids' own: their float32, greedy and serving engine tests run here again over
# this module's `case`)
from test_hybrids import (  # noqa: F401
    assert_the_gpu_engine_runs_it_as_the_cpu_does,
    edited,
    ids,
    refused,
    test_float32_logits_equal_transformers,
    test_greedy_equals_transformers_greedy_and_a_batch_equals_each_alone,
    test_the_prefix_cache_and_chunks_change_no_token,
)

# (and the MoE hybrids': decode steps after a prefill, bf16 storage, over this module's `case`)
from test_moe import (  # noqa: F401
    every_expert,
    test_bfloat16_storage_within_transformers_own_error,
    test_decode_steps_continue_the_prefill,
)
from test_moe import save as moe_save

import fastmamba
from fastmamba.core import moe
from fastmamba.core.layers import off_gpu_engine
from fastmamba.core.ops import REFERENCE_OPS

transformers = pytest.importorskip("transformers")

V = 160


def jamba(**kw):
    """4 layers: Mamba, attention, Mamba, attention (attn_layer_period 2, offset 1 unless
    changed), experts at layers 1 and 3 (expert_layer_period 2, offset 1 unless changed)."""
    args = dict(vocab_size=V, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=48, num_experts=4, num_experts_per_tok=2, attn_layer_period=2, attn_layer_offset=1,
                expert_layer_period=2, expert_layer_offset=1, mamba_d_state=8, mamba_dt_rank=6)
    return transformers.JambaConfig(**{**args, **kw})


CASES = {
    "two_a_token_untied": lambda: jamba(),
    "one_a_token_tied_biases": lambda: jamba(num_experts_per_tok=1, tie_word_embeddings=True, mamba_proj_bias=True,
                                             mamba_conv_bias=False, mamba_dt_rank="auto", attn_layer_offset=0,
                                             expert_layer_offset=0),
    "dense": lambda: jamba(num_experts=1, num_hidden_layers=2),
}


def save(config, folder, router=None):
    """test_moe's random model, the dt, B and C norms among the norms spread (wider)."""
    return moe_save(config, folder, router, spread=0.2)


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    return folder, save(CASES[request.param](), folder)


def test_the_config_and_the_weights(case):
    folder, hf = case
    lm = fastmamba.load(folder)
    c, layers = lm.config, lm.model.weights.layers
    assert lm.engine == "reference" and c.family == "jamba" and c.dbc_norm_eps == hf.config.rms_norm_eps
    mixers = ["attention" if t == "attention" else "mamba1_normed" for t in hf.config.layers_block_type]
    ffs = ["moe" if n > 1 else "mlp" for n in hf.config.layers_num_experts]
    assert c.kinds == tuple(k for pair in zip(mixers, ffs) for k in pair)
    assert c.tie_embeddings == hf.config.tie_word_embeddings and c.dt_rank == hf.config.mamba_dt_rank
    mamba = layers[c.kinds.index("mamba1_normed")]
    assert [w.shape for w in mamba.dbc_norm_w] == [(c.dt_rank,), (8,), (8,)]
    if "moe" in c.kinds:
        assert (c.n_experts, c.expert_size, c.router, c.experts_per_token) == (
            4, 48, "softmax_all", hf.config.num_experts_per_tok)
        at = c.kinds.index("moe")
        lw, experts = layers[at], hf.model.layers[at // 2].feed_forward.experts
        assert lw.shared_in is None and lw.in_w.shape == (4, 96, 64) and lw.out_w.shape == (4, 64, 48)
        assert torch.equal(lw.in_w, experts.gate_up_proj) and torch.equal(lw.out_w, experts.down_proj)
    else:
        assert c.n_experts == 0 and "mlp" in c.kinds


def test_the_router_picks_and_weighs_as_transformers(case):
    """On random inputs (no ties): transformers' router's experts (in its order) and weights,
    not renormalized (a token's weights sum to less than 1)."""
    folder, hf = case
    model = fastmamba.load(folder).model
    if "moe" not in model.config.kinds:
        pytest.skip("a dense model")
    at = model.config.kinds.index("moe")
    x = torch.randn(64, model.config.d_model, generator=torch.Generator().manual_seed(3))
    experts, weights = moe.route(model.config, model.weights.layers[at], x, REFERENCE_OPS)
    with torch.no_grad():
        _, want_weights, want_experts = hf.model.layers[at // 2].feed_forward.router(x)
    assert torch.equal(experts, want_experts) and relative_error(weights, want_weights) < 1e-6
    assert weights.sum(-1).mean() < 0.95


def test_experts_that_no_token_picks_are_skipped(case):
    """One token (as a batch-1 decode step has): k experts run, the others get no token; the
    sum is the all-experts oracle's; so is a batch's."""
    folder, _ = case
    model = fastmamba.load(folder).model
    c = model.config
    if "moe" not in c.kinds:
        pytest.skip("a dense model")
    lw = model.weights.layers[c.kinds.index("moe")]
    for n in (1, 3, 17):
        x = torch.randn(n, c.d_model, generator=torch.Generator().manual_seed(n))
        picked, _ = moe.route(c, lw, x, REFERENCE_OPS)
        if n == 1:
            assert len(picked.unique()) == c.experts_per_token < c.n_experts
        got = moe.moe(c, lw, x.view(1, n, -1), REFERENCE_OPS)[0]
        assert relative_error(got, every_expert(c, lw, x)) < 1e-5


@pytest.mark.parametrize("k", [1, 2])
def test_ties_pick_as_transformers_and_unpicked_experts_get_no_token(tmp_path, k):
    """A router of zeros: every probability is 1 / 4, so each token takes the experts
    torch.topk gives first (transformers' order) at weight 1 / 4 each (not renormalized), and
    the others get no token, through a whole model."""
    folder = tmp_path / "m"
    hf = save(jamba(num_experts_per_tok=k), folder, router=lambda w: w.zero_())
    lm = fastmamba.load(folder)
    c = lm.config
    lw = lm.model.weights.layers[c.kinds.index("moe")]
    experts, weights = moe.route(c, lw, torch.randn(7, c.d_model), REFERENCE_OPS)
    assert torch.equal(experts, hf.model.layers[1].feed_forward.router(torch.randn(7, c.d_model))[2])
    assert len(experts.unique()) == k < c.n_experts and torch.equal(weights, torch.full_like(weights, 0.25))
    x = ids(2, 25, seed=2)
    with torch.no_grad():
        want = hf(x).logits
    assert relative_error(lm.forward(x), want) < 2e-3


def test_the_gpu_engine_takes_jamba(case):
    """Jamba's kinds (Mamba-1 mixers with dt, B and C norms, attention, experts) all run on
    the GPU engine, through its layer-ops decode step: fastmamba.load picks it on CUDA."""
    assert off_gpu_engine(fastmamba.load(case[0]).config) == []


# -- refused by name ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    folder = tmp_path_factory.mktemp("small")
    save(jamba(), folder)
    return folder


@pytest.mark.parametrize("change,words", [
    (lambda c: c.update(hidden_act="gelu"), ("'hidden_act'", "gelu")),
    (lambda c: c.update(norm_topk_prob=True), ("'norm_topk_prob'", "not renormalized")),
    (lambda c: c.update(routed_scaling_factor=2.0), ("'routed_scaling_factor'",)),
    (lambda c: c.update(num_experts_per_tok=5), ("'num_experts_per_tok'", "5")),
    (lambda c: c.update(attention_bias=True), ("'attention_bias'",)),
    (lambda c: c.update(sliding_window=8), ("'sliding_window'",)),
    (lambda c: c.update(attn_layer_offset=2), ("'attn_layer_offset'", "'attn_layer_period'")),
    (lambda c: c.update(expert_layer_offset=-1), ("'expert_layer_offset'",)),
    (lambda c: c.update(mamba_dt_rank="wide"), ("'mamba_dt_rank'",)),
    (lambda c: c.update(num_key_value_heads=3), ("'num_key_value_heads'",)),
    (lambda c: c.update(num_experts=4, num_local_experts=8), ("'num_experts'", "'num_local_experts'", "disagree")),
    (lambda c: c.update(intermediate_size=40), ("feed_forward.", "has shape")),
    (lambda c: c.update(mamba_d_state=16), ("mamba.", "has shape")),
    (lambda c: c.update(num_experts=1), ("missing tensor", "model.layers.1.feed_forward.gate_proj.weight")),
    (lambda c: c.update(attn_layer_offset=0), ("missing tensor",)),
])
def test_configs_that_change_the_math_are_refused_by_name(small, tmp_path, change, words):
    refused(edited(small, tmp_path, change), *words)


def test_the_kernel_and_training_keys_are_accepted(small, tmp_path):
    path = edited(small, tmp_path, lambda c: c.update(
        use_mamba_kernels=False, use_mambapy=True, use_associative_scan=False, num_logits_to_keep=1,
        output_router_logits=True, router_aux_loss_coef=0.02, norm_topk_prob=False, sliding_window=None))
    assert fastmamba.load(path).config.n_experts == 4


@pytest.mark.parametrize("name,shape", [("model.layers.0.mamba.dt_layernorm.weight", (5,)),
                                        ("model.layers.2.mamba.c_layernorm.weight", (16,)),
                                        ("model.layers.1.feed_forward.experts.3.gate_proj.weight", (48, 63)),
                                        ("model.layers.3.feed_forward.experts.0.up_proj.weight", (47, 64)),
                                        ("model.layers.3.feed_forward.router.weight", (5, 64)),
                                        ("model.layers.1.self_attn.k_proj.weight", (64, 64)),
                                        ("model.layers.2.feed_forward.down_proj.weight", (64, 47))])
def test_a_tensor_of_the_wrong_shape_is_named(small, tmp_path, name, shape):
    from safetensors.torch import load_file, save_file

    out = tmp_path / "m"
    out.mkdir()
    for f in small.iterdir():
        (out / f.name).write_bytes(f.read_bytes())
    tensors = load_file(str(out / "model.safetensors"))
    assert name in tensors
    tensors[name] = torch.zeros(shape)
    save_file(tensors, str(out / "model.safetensors"))
    refused(str(out), f"'{name}' has shape {shape}")


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["two_a_token_untied", "dense"])
def test_the_gpu_engine_runs_it_as_the_cpu_does(tmp_path, name):
    """On CUDA the default engine, the GPU one (the mixers over the GPU ops, the experts through
    the fused kernel, decode steps in CUDA graphs): tests/test_hybrids.py's check against the
    CPU (the dense model too)."""
    save(CASES[name](), tmp_path)
    assert_the_gpu_engine_runs_it_as_the_cpu_does(tmp_path)
