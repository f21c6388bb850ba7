"""The mixture-of-experts sublayer (core/moe.py) on the reference engine: Granite-4.0-H with
experts and Nemotron-H's "E" layers against transformers' own GraniteMoeHybrid and NemotronH
classes (tiny checkpoints written by `save_pretrained`: Mamba-2 and attention layers, RoPE
and none, one and two experts a token; Nemotron's groups, correction bias and scaling),
routing ties and experts no token picks, and the configs and tensors refused by name."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from conftest import assert_within_transformers_16bit_error, relative_error, transformers_logits

# (the dense hybrids' own: their float32 and greedy tests run here again over this module's `case`)
from test_hybrids import (  # noqa: F401
    assert_steps_continue_the_prefill,
    edited,
    ids,
    refused,
    test_float32_logits_equal_transformers,
    test_greedy_equals_transformers_greedy_and_a_batch_equals_each_alone,
)

import fastmamba
from fastmamba.core import moe
from fastmamba.core.fp8 import Fp8Weight
from fastmamba.core.ops import REFERENCE_OPS

transformers = pytest.importorskip("transformers")

V = 160


def granite_moe(position="rope", k=2, **kw):
    return transformers.GraniteMoeHybridConfig(
        vocab_size=V, hidden_size=64, num_hidden_layers=3, layer_types=["mamba", "attention", "mamba"],
        num_attention_heads=4, num_key_value_heads=1, shared_intermediate_size=96, intermediate_size=48,
        num_local_experts=4, num_experts_per_tok=k, position_embedding_type=position, embedding_multiplier=6.0,
        logits_scaling=4.0, residual_multiplier=0.3, attention_multiplier=0.05, mamba_n_heads=8, mamba_d_state=16,
        mamba_n_groups=2, mamba_chunk_size=8, **kw)


def nemotron_moe(k=2, **kw):
    """Nemotron-H with experts (Nemotron 3): squared-ReLU experts, sigmoid routing with a
    correction bias, groups, scaling; an MLP layer of another width than the shared expert."""
    return transformers.NemotronHConfig(
        vocab_size=V, hidden_size=64, layers_block_type=["mamba", "moe", "attention", "moe", "mlp"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=96, mamba_num_heads=8,
        mamba_head_dim=16, ssm_state_size=16, n_groups=2, chunk_size=8, n_routed_experts=8, num_experts_per_tok=k,
        moe_intermediate_size=32, moe_shared_expert_intermediate_size=48, **kw)


CASES = {
    "granite_rope_two_a_token": lambda: granite_moe("rope", k=2),
    "granite_nope_one_a_token_tied": lambda: granite_moe("nope", k=1, tie_word_embeddings=True),
    "nemotron_groups_scaled": lambda: nemotron_moe(k=2, n_group=4, topk_group=2, routed_scaling_factor=2.5),
    "nemotron_one_a_token_unnormalized": lambda: nemotron_moe(k=1, norm_topk_prob=False),
}


# the routers' tensors: Nemotron-H's (zeros at init) and its correction bias, Jamba's
ROUTERS = ("gate.weight", "e_score_correction_bias", "router.weight")


def save(config, folder, router=None, spread: float = 0.1):
    """A random model of `config` (transformers' class for it) saved to `folder`: norms spread
    by `spread`, so the multipliers and a norm read from the wrong place show; the routers'
    tensors (ROUTERS) random; `router(weight)` edits each layer's router weight (and bias)
    in place."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, p in [*model.named_parameters(), *model.named_buffers()]:
            if "norm" in name:
                p.add_(spread * torch.randn_like(p))
            if name.endswith(ROUTERS):
                p.normal_(0.0, 0.3)
                if router is not None:
                    router(p)
    model.save_pretrained(folder)
    return model


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    return folder, save(CASES[request.param](), folder)




def test_the_config_and_the_weights(case):
    folder, hf = case
    lm = fastmamba.load(folder)
    c = lm.config
    lw = lm.model.weights.layers[1]
    assert lm.engine == "reference" and c.experts_per_token == hf.config.num_experts_per_tok
    if c.family == "nemotron_h":
        assert c.kinds == ("mamba2", "moe", "attention", "moe", "mlp")
        assert (c.n_experts, c.expert_size, c.shared_size, c.mlp_size, c.router) == (8, 32, 48, 96, "sigmoid")
        assert lw.in_w.shape == (8, 32, 64) and lw.out_w.shape == (8, 64, 32) and lw.router_b.shape == (8,)
    else:
        assert c.kinds == ("mamba2", "moe", "attention", "moe", "mamba2", "moe")
        assert (c.n_experts, c.expert_size, c.router) == (4, 48, "softmax")
        assert lw.in_w.shape == (4, 96, 64) and lw.out_w.shape == (4, 64, 48) and lw.router_w.shape == (4, 64)


def test_decode_steps_continue_the_prefill(case):
    assert_steps_continue_the_prefill(case[0], 30, 22)


def test_bfloat16_storage_within_transformers_own_error(case):
    folder, _ = case
    x = ids(2, 33, seed=5)
    assert_within_transformers_16bit_error(fastmamba.load(folder, dtype="bfloat16").forward(x), folder, x, "bfloat16")


def test_fp8_weights_quantize_each_expert(case):
    """dtype='fp8': the stacked experts as e4m3 values with a scale per expert's row."""
    folder, _ = case
    lm = fastmamba.load(folder, dtype="fp8")
    lw = lm.model.weights.layers[1]
    assert isinstance(lw.in_w, Fp8Weight) and lw.in_w.scale.shape == lw.in_w.shape[:2]
    assert torch.isfinite(lm.forward(ids(2, 20, seed=6))).all()
    # each expert's product reads its own values and scales: the sublayer equals it over the
    # dequantized matrices
    c = lm.config
    dense = moe.MoEWeights(lw.norm_w, lw.router_w, lw.in_w.dequantize(), lw.out_w.dequantize(),
                           lw.shared_in.dequantize(), lw.shared_out.dequantize(), lw.router_b)
    u = torch.randn(1, 9, c.d_model, generator=torch.Generator().manual_seed(2))
    assert relative_error(moe.moe(c, lw, u, REFERENCE_OPS), moe.moe(c, dense, u, REFERENCE_OPS)) < 1e-5


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


@pytest.mark.parametrize("name", ["granite_rope_two_a_token", "nemotron_groups_scaled"])
def test_the_one_row_step_equals_the_reference_and_a_row_alone_its_bits_in_a_batch(tmp_path, name):
    """tests/test_hybrids.py's test of the one-row step over two of the models with experts
    (Granite's softmax over two picks and its shared MLP; Nemotron's sigmoid with groups,
    scaling and a correction bias): logits and states against the reference's steps, a row
    alone the same bits as in a batch. (All four models' experts: the test below.)"""
    from test_hybrids import assert_the_one_row_step_equals_the_reference

    save(CASES[name](), tmp_path)
    assert_the_one_row_step_equals_the_reference(tmp_path)


def test_the_one_row_steps_experts_kernels_equal_their_twins(case):
    """The one-row step's mixture of experts (kernels/decode_step_hybrid.py: moe_in, moe_out)
    alone, on random rows of the residual stream with a pending share: the activations and
    the output against moe_in_ref and moe_out_ref over the reference's routing, and the
    share folded into h."""
    pytest.importorskip("triton")
    from fastmamba.core.model import Mamba
    from fastmamba.core.ops import triton_ops
    from fastmamba.engine.decode_step import make_decode_step
    from fastmamba.engine.plan import KERNEL_TILES, DecodePlan, one_row_blocks
    from fastmamba.kernels.decode_step_hybrid import moe_in_ref, moe_out_ref
    from fastmamba.kernels.gemv import from_fixed, to_fixed
    from fastmamba.kernels.moe import route_ref
    from fastmamba.kernels.rmsnorm import residual_rmsnorm_ref

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = fastmamba.load(case[0], device=device).model
    model = Mamba(model.config, model.weights, triton_ops(KERNEL_TILES))
    c = model.config
    # (the experts' products in settings of their own, several tiles along K and d: the table's
    # plan, which gives them in_proj's and out_proj's, runs in the test above)
    blocks = replace(one_row_blocks(c.d_model, c.d_inner, c.vocab_size, model.weights.dtype, c.layer),
                     moe_in=(16, 32, 4), moe_out=(16, 32, 4, 64))
    step = make_decode_step(model, 3, plan=DecodePlan("one-row", blocks=blocks))
    lw = next(lw for kind, lw in zip(c.kinds, model.weights.layers) if kind == "moe")
    g = torch.Generator().manual_seed(1)
    step.h.copy_(torch.randn(3, c.d_model, generator=g))
    step.dh.copy_(to_fixed(0.1 * torch.randn(3, c.d_model, generator=g)))
    h = (step.h + from_fixed(step.dh)).cpu()
    step.moe(lw, step.dh, step.dh2)
    u = residual_rmsnorm_ref(h, None, None, lw.norm_w.cpu(), c.norm_eps)[1]
    cpu = fastmamba.load(case[0]).model.weights.layers[c.kinds.index("moe")]
    experts, weights = route_ref(u @ cpu.router_w.T, c.router, c.experts_per_token, cpu.router_b, c.expert_groups,
                                 c.topk_groups, c.norm_topk, c.routed_scaling)
    a = moe_in_ref(h, cpu.norm_w, c.norm_eps, experts, cpu.in_w, cpu.shared_in, c.mlp_act, c.mlp_gated)
    assert relative_error(step.moe_a.cpu(), a) < 1e-5
    want = moe_out_ref(a, experts, weights, cpu.out_w, cpu.shared_out)
    assert relative_error(from_fixed(step.dh2).cpu(), want) < 1e-5
    assert torch.allclose(step.h.cpu(), h) and not step.dh.any()  # (the pending share folded into h)


def transformers_route(hf, x):
    """transformers' own router of the model's first MoE layer on x (N, d): (experts, weights)."""
    with torch.no_grad():
        if isinstance(hf, transformers.NemotronHForCausalLM):
            _, weights, experts = hf.model.layers[1].mixer.gate(x)
        else:
            _, weights, experts = hf.model.layers[0].block_sparse_moe.router(x)
    return experts, weights.float()


@pytest.mark.parametrize("make", [lambda: granite_moe("nope", k=1), lambda: granite_moe("nope", k=2),
                                  lambda: nemotron_moe(k=2, n_group=4, topk_group=2, routed_scaling_factor=2.5)],
                         ids=["granite_k1", "granite_k2", "nemotron_groups"])
def test_ties_pick_as_transformers_and_unpicked_experts_are_skipped(tmp_path, make):
    """A router of zeros (and a zero correction bias): every score ties, so each token takes
    the experts torch.topk gives first (transformers' order) at equal weights, and the others
    get no token."""
    folder = tmp_path / "m"
    hf = save(make(), folder, router=lambda w: w.zero_())
    lm = fastmamba.load(folder)
    c, lw = lm.config, lm.model.weights.layers[1]
    x = torch.randn(7, c.d_model)
    experts, weights = moe.route(c, lw, x, REFERENCE_OPS)
    want_experts, want_weights = transformers_route(hf, x)
    assert torch.equal(experts, want_experts) and relative_error(weights, want_weights) < 1e-6
    assert len(experts.unique()) == c.experts_per_token < c.n_experts
    assert torch.equal(weights, torch.full_like(weights, weights[0, 0].item()))
    x = ids(2, 25, seed=2)
    assert relative_error(lm.forward(x), transformers_logits(folder, x)) < 2e-3
    p = ids(1, 9, seed=4)[0].tolist()
    with torch.no_grad():
        want = hf.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert lm.generate(p, max_tokens=8, stop_token_ids=[]).token_ids == want[0, len(p):].tolist()


def test_the_router_picks_and_weighs_as_transformers(case):
    """On random inputs (no ties): transformers' router's experts (in its order) and weights."""
    folder, hf = case
    model = fastmamba.load(folder).model
    x = torch.randn(64, model.config.d_model, generator=torch.Generator().manual_seed(3))
    experts, weights = moe.route(model.config, model.weights.layers[1], x, REFERENCE_OPS)
    want_experts, want_weights = transformers_route(hf, x)
    assert torch.equal(experts, want_experts) and relative_error(weights, want_weights) < 1e-5


def every_expert(c, lw, x):
    """The routed sum computed by running every expert on every token (x (N, d)): the oracle
    (Granite's routing computed here; Nemotron-H's taken from moe.route)."""
    logits = x @ lw.router_w.T  # (N, E)
    if c.router == "softmax":
        top, picked = logits.topk(c.experts_per_token, dim=-1)
        weights = torch.softmax(top, dim=-1)
    else:
        picked, weights = moe.route(c, lw, x, REFERENCE_OPS)
    gates = torch.zeros_like(logits).scatter(1, picked, weights)  # (N, E)
    out = torch.zeros_like(x)
    for e in range(c.n_experts):
        a = x @ lw.in_w[e].float().T
        if c.mlp_gated:
            h = torch.nn.functional.silu(a[:, : c.expert_size]) * a[:, c.expert_size :]
        else:
            h = torch.relu(a).square()
        out += gates[:, e : e + 1] * (h @ lw.out_w[e].float().T)
    return out


def test_experts_that_no_token_picks_are_skipped(case):
    """One token (as a batch-1 decode step has): k experts run, the others get no token; the
    sum is the all-experts oracle's; so is a batch's."""
    folder, _ = case
    model = fastmamba.load(folder).model
    c, lw = model.config, model.weights.layers[3]
    lw = moe.MoEWeights(lw.norm_w, lw.router_w, lw.in_w, lw.out_w, router_b=lw.router_b)  # (the routed part alone)
    for n in (1, 3, 17):
        x = torch.randn(n, c.d_model, generator=torch.Generator().manual_seed(n))
        picked, _ = moe.route(c, lw, x, REFERENCE_OPS)
        if n == 1:
            assert len(picked.unique()) == c.experts_per_token < c.n_experts
        got = moe.moe(c, lw, x.view(1, n, -1), REFERENCE_OPS)[0]
        assert relative_error(got, every_expert(c, lw, x)) < 1e-5


# -- refused by name ---------------------------------------------------------------------------


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


@pytest.fixture(scope="module")
def small_nemotron(tmp_path_factory):
    folder = tmp_path_factory.mktemp("small_nemotron")
    save(nemotron_moe(k=2, n_group=4, topk_group=2), folder)
    return folder


@pytest.mark.parametrize("change,words", [
    (lambda c: c.update(moe_latent_size=16), ("'moe_latent_size'", "latent")),
    (lambda c: c.update(n_shared_experts=2), ("'n_shared_experts'",)),
    (lambda c: c.update(n_group=3), ("'n_group'", "3")),
    (lambda c: c.update(topk_group=5), ("'topk_group'",)),
    (lambda c: c.update(topk_group=1, num_experts_per_tok=3), ("'num_experts_per_tok'", "3")),
    (lambda c: c.update(moe_intermediate_size=40), ("experts.0.up_proj.weight", "has shape")),
    (lambda c: c.update(moe_shared_expert_intermediate_size=40), ("shared_experts.up_proj.weight", "has shape")),
    (lambda c: c.update(n_routed_experts=4, n_group=2), ("unexpected tensor", "mixer.experts.4.")),
])
def test_nemotron_routing_and_sizes_that_change_the_math_are_refused_by_name(small_nemotron, tmp_path, change,
                                                                              words):
    refused(edited(small_nemotron, tmp_path, change), *words)


def test_nemotron_reads_the_hub_pattern_with_experts(small_nemotron, tmp_path):
    def hub_form(c):
        del c["layers_block_type"]
        c["hybrid_override_pattern"] = "ME*E-"
    assert fastmamba.load(edited(small_nemotron, tmp_path, hub_form)).config.kinds == (
        "mamba2", "moe", "attention", "moe", "mlp")


def test_the_training_keys_are_accepted(small, tmp_path):
    path = edited(small, tmp_path, lambda c: c.update(output_router_logits=True, router_aux_loss_coef=0.02,
                                                      router_jitter_noise=0.1, norm_topk_prob=True))
    assert fastmamba.load(path).config.n_experts == 4


@pytest.mark.parametrize("name,shape", [("model.layers.2.block_sparse_moe.output_linear.weight", (4, 64, 40)),
                                        ("model.layers.2.block_sparse_moe.input_linear.weight", (3, 96, 64)),
                                        ("model.layers.2.block_sparse_moe.router.layer.weight", (4, 32)),
                                        ("backbone.layers.3.mixer.experts.5.down_proj.weight", (64, 31)),
                                        ("backbone.layers.1.mixer.gate.e_score_correction_bias", (9,))])
def test_an_expert_tensor_of_the_wrong_shape_is_named(small, small_nemotron, tmp_path, name, shape):
    from safetensors.torch import load_file, save_file

    out = tmp_path / "m"
    out.mkdir()
    for f in (small if name.startswith("model.") else small_nemotron).iterdir():
        (out / f.name).write_bytes(f.read_bytes())
    tensors = load_file(str(out / "model.safetensors"))
    assert name in tensors
    tensors[name] = torch.zeros(shape)
    save_file(tensors, str(out / "model.safetensors"))
    refused(str(out), f"'{name}' has shape {shape}")


def test_building_the_weights_drops_each_sublayers_sources(small_nemotron):
    """build_weights consumes its tensors a sublayer at a time (experts stored one by one are
    stacked into new tensors: with both alive, a model whose tensors are already on the GPU
    held its experts twice); what is left is the embedding, head and final norm, and the
    weights are those fastmamba.load builds."""
    from fastmamba.core.config import MambaConfig
    from fastmamba.io.checkpoint import build_weights, read_tensors

    config = MambaConfig.from_file(small_nemotron / "config.json")
    tensors, origin = read_tensors(small_nemotron, config)
    assert any(".experts.5." in name for name in tensors)
    weights = build_weights(config, tensors, origin, "cpu", torch.float32)
    assert all(not name.startswith("backbone.layers.") for name in tensors), sorted(tensors)[:5]
    loaded = fastmamba.load(small_nemotron).model.weights
    moe_at = config.kinds.index("moe")
    assert torch.equal(weights.layers[moe_at].in_w, loaded.layers[moe_at].in_w)
