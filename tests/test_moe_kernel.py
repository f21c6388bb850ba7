"""The fused mixture-of-experts kernel (kernels/moe.py): moe_align's grouping against a plain
Python one; the grouped products (Triton's interpreter here) against their twin for gated
SiLU and squared-ReLU experts, float32, bfloat16 and FP8 weights, token counts that are not
a multiple of the block; a token's output bitwise the same alone and in a batch; the MoE
sublayer over the GPU ops. On a GPU: tiny Granite-4.0-H and Nemotron-H models with experts
over the GPU ops against the CPU reference engine, and batch invariance there."""

from __future__ import annotations

import collections
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_within_transformers_16bit_error, relative_error

from fastmamba.core import moe
from fastmamba.core.fp8 import Fp8Weight, quantize
from fastmamba.core.ops import REFERENCE_OPS
from fastmamba.kernels.moe import MoETiles, moe_align, moe_ffn_ref

# (the interpreter's: small, tl.dot's least; past 256 pairs, or at align_pairs 0, chunks of 32)
TILES = MoETiles(bm=16, bn=32, bk=32, warps=4, stages=2, align_pairs=256, align_chunk=32)


def python_grouping(experts: torch.Tensor, n_experts: int, bm: int) -> tuple[list[int], list[int], int]:
    """The pairs grouped by expert in pair order, each group padded with P to whole blocks;
    each block's expert; the number of blocks."""
    pairs = experts.flatten().tolist()
    P = len(pairs)
    ids, block_expert = [], []
    for e in range(n_experts):
        group = [p for p in range(P) if pairs[p] == e]
        blocks = -(-len(group) // bm)
        ids += group + [P] * (blocks * bm - len(group))
        block_expert += [e] * blocks
    return ids, block_expert, len(block_expert)


ROUTINGS = {
    "all_experts_k2": (lambda g: torch.stack([torch.randperm(6, generator=g)[:2] for _ in range(23)]), 6),
    "an_expert_unpicked_k1": (lambda g: torch.randint(0, 4, (17, 1), generator=g) * (torch.arange(17)[:, None] % 5 > 0), 5),
    "one_token_k2": (lambda g: torch.tensor([[3, 1]]), 8),
    "every_token_ties_k2": (lambda g: torch.tensor([[2, 0]] * 9), 4),  # (equal experts keep pair order)
    "full_blocks_k1": (lambda g: torch.arange(8).repeat_interleave(4)[:, None], 8),
    # (many chunks of 32 pairs: an expert's pairs in several, a chunk without some experts)
    "many_pairs_k3": (lambda g: torch.stack([torch.randperm(7, generator=g)[:3] for _ in range(70)]) % 6, 7),
}


@pytest.mark.parametrize("name", list(ROUTINGS))
@pytest.mark.parametrize("bm", [1, 4, 16])
@pytest.mark.parametrize("how", ["sorted", "one_program", "chunks"])
def test_moe_align_groups_the_pairs_as_python_does(name, bm, how):
    """moe_align (torch's sort) and moe_align_triton (Triton's interpreter here) in one
    program and in chunks of 32 pairs."""
    make, E = ROUTINGS[name]
    experts = make(torch.Generator().manual_seed(bm))
    align = moe_align
    if how != "sorted":
        pytest.importorskip("triton")
        from fastmamba.kernels.moe import moe_align_triton

        def align(experts, E, bm):
            return moe_align_triton(experts, E, bm, chunk=32 if how == "chunks" else None)
    ids, block_expert, blocks = align(experts, E, bm)
    want_ids, want_experts, want_blocks = python_grouping(experts, E, bm)
    P = experts.numel()
    assert blocks.tolist() == [want_blocks] and ids.dtype == torch.int64
    # the buffers are sized for the most any routing of P pairs over E experts can need
    assert ids.shape[0] == block_expert.shape[0] * bm == (P + min(E, P) * (bm - 1)) // bm * bm
    assert ids[: len(want_ids)].tolist() == want_ids and (ids[len(want_ids) :] == P).all()
    assert block_expert[:want_blocks].tolist() == want_experts and (block_expert[want_blocks:] == E).all()
    if experts.unique().numel() < E:  # (an expert no token picked has no block)
        assert set(block_expert[:want_blocks].tolist()) == set(experts.unique().tolist())


def experts_case(gated: bool, dtype, seed: int = 0, E: int = 5, d: int = 40, I: int = 24):
    """Random experts (E, 2 I or I, d) and (E, d, I) in `dtype` (or FP8)."""
    g = torch.Generator().manual_seed(seed)
    in_w = torch.randn(E, (2 if gated else 1) * I, d, generator=g) / d**0.5
    out_w = torch.randn(E, d, I, generator=g) / I**0.5
    if dtype == "fp8":
        return quantize(in_w), quantize(out_w)
    return in_w.to(dtype), out_w.to(dtype)


def routing(N: int, k: int, E: int, seed: int = 1, d: int = 40):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, d, generator=g)
    top, experts = torch.randn(N, E, generator=g).topk(k, dim=-1)
    return x, experts, torch.softmax(top, dim=-1)


def rounded_linear(x, w):
    """The reference product with its input rounded as the kernel rounds it (to the weight's
    dtype; bfloat16 for FP8's)."""
    operand = torch.bfloat16 if isinstance(w, Fp8Weight) else w.dtype
    if isinstance(w, Fp8Weight):
        return F.linear(x.to(operand).float(), w.data.float()) * w.scale
    return F.linear(x.to(operand).float(), w.float())


FAMILIES = [("silu", True), ("relu2", False)]


@pytest.mark.parametrize("act,gated", FAMILIES, ids=["gated_silu", "squared_relu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, "fp8"], ids=["float32", "bfloat16", "fp8"])
@pytest.mark.parametrize("N,k", [(13, 2), (37, 1)])
def test_the_kernel_equals_its_twin(act, gated, dtype, N, k):
    """N not a multiple of the block (16); some experts get no token at N 13, k 2 over 5."""
    pytest.importorskip("triton")
    from fastmamba.kernels.moe import moe_ffn_triton

    in_w, out_w = experts_case(gated, dtype, seed=N)
    x, experts, weights = routing(N, k, 5, seed=N + k)
    got = moe_ffn_triton(x, experts, weights, in_w, out_w, act, gated, tiles=TILES)
    assert got.shape == (N, 40) and got.dtype == torch.float32
    # the twin with the kernel's roundings (the input and the hidden activations to the operand dtype)
    want = moe_ffn_ref(x, experts, weights, in_w, out_w, act, gated, linear=rounded_linear)
    assert relative_error(got, want) < 1e-5
    # and the reference's own (float32 activations): within the operand rounding (~4e-3 here)
    plain = moe_ffn_ref(x, experts, weights, in_w, out_w, act, gated, linear=REFERENCE_OPS.linear)
    assert relative_error(got, plain) < (1e-5 if dtype == torch.float32 else 1e-2)
    broken = moe_ffn_ref(x, (experts + 1) % 5, weights, in_w, out_w, act, gated, linear=rounded_linear)
    assert relative_error(got, broken) > 1e-2  # (the test can fail: other experts)
    # a shared MLP's output added in the picks' sum: the twin's bits for the sum it adds to
    shared = torch.randn(N, 40, generator=torch.Generator().manual_seed(5))
    summed = moe_ffn_triton(x, experts, weights, in_w, out_w, act, gated, add=shared, tiles=TILES)
    assert torch.equal(summed, got + shared)


@pytest.mark.parametrize("act,gated", FAMILIES, ids=["gated_silu", "squared_relu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, "fp8"], ids=["float32", "bfloat16", "fp8"])
def test_a_token_is_the_same_bits_alone_and_in_a_batch(act, gated, dtype):
    pytest.importorskip("triton")
    from fastmamba.kernels.moe import moe_ffn_triton

    in_w, out_w = experts_case(gated, dtype)
    x, experts, weights = routing(21, 2, 5)
    together = moe_ffn_triton(x, experts, weights, in_w, out_w, act, gated, tiles=TILES)
    for t in (0, 7, 20):
        alone = moe_ffn_triton(x[t : t + 1], experts[t : t + 1], weights[t : t + 1], in_w, out_w, act, gated, tiles=TILES)
        assert torch.equal(alone[0], together[t]), t
    assert torch.equal(together, moe_ffn_triton(x, experts, weights, in_w, out_w, act, gated, tiles=TILES))
    # the grouping in chunks of 32 pairs (past TILES.align_pairs: two launches) and by one
    # program: the same bits
    chunked = moe_ffn_triton(x, experts, weights, in_w, out_w, act, gated, tiles=replace(TILES, align_pairs=0))
    assert torch.equal(together, chunked)


def test_the_plans_launch_takes_its_tiles_by_the_tokens_and_the_deterministic_step_one_set(monkeypatch, tmp_path_factory):
    """MOE_TILES picks `few` below `many_from` tokens and `many` from there; the deterministic
    decode step (layer-ops without cuBLAS) keeps `few` at any count, so that a token's bits
    do not follow the batch."""
    pytest.importorskip("triton")
    import fastmamba
    from fastmamba.engine.decode_step import OpsDecodeStep
    from fastmamba.engine.plan import LAYER_OPS_DETERMINISTIC, MOE_TILES
    from fastmamba.kernels import moe as kmoe

    seen = []
    monkeypatch.setattr(kmoe, "_grouped_product", lambda *args: seen.append(args[-1]))  # (its tiles: the last)
    no_launch = collections.defaultdict(lambda: lambda *args, **kw: None)  # (nothing to sum: no products ran)
    monkeypatch.setattr(kmoe, "_sum_picks_kernel", no_launch)
    in_w, out_w = experts_case(True, torch.float32)
    E, d = in_w.shape[0], in_w.shape[2]
    many = MOE_TILES.many_from
    for n, want in ((1, MOE_TILES.few), (many - 1, MOE_TILES.few), (many, MOE_TILES.many)):
        x, experts, weights = torch.randn(n, d), torch.randint(0, E, (n, 2)), torch.rand(n, 2)
        seen.clear()
        kmoe.moe_ffn_triton(x, experts, weights, in_w, out_w, "silu", True, tiles=MOE_TILES)
        assert seen == [want, want], n
    step = OpsDecodeStep(fastmamba.load(tiny_checkpoint("granite", tmp_path_factory)).model, LAYER_OPS_DETERMINISTIC)
    seen.clear()
    step.model.ops.moe(x, experts, weights, in_w, out_w, "silu", True)  # (many tokens: still `few`)
    assert seen == [MOE_TILES.few, MOE_TILES.few]


@pytest.mark.parametrize("router, bias, norm, scaling", [("softmax", False, True, 1.0), ("softmax_all", False, True, 1.0),
                                                       ("sigmoid", True, True, 2.5), ("sigmoid", False, False, 1.0)])
@pytest.mark.parametrize("E, k", [(40, 1), (40, 2), (130, 6)])
def test_the_route_kernel_picks_and_weighs_as_its_twin(router, bias, norm, scaling, E, k):
    """kernels/moe.route_triton (Triton's interpreter here) against route_ref, every router
    kind of the public checkpoints (Granite's, Jamba's, Nemotron-H's with and without its
    correction bias, renormalized or not), widths that are not a power of two: the same
    experts, each with its weight; the softmax routers' in the same order (descending)."""
    pytest.importorskip("triton")
    from fastmamba.kernels.moe import route_ref, route_triton

    g = torch.Generator().manual_seed(E + k)
    logits = 3 * torch.randn(9, E, generator=g)
    b = torch.rand(E, generator=g) if bias else None
    got_e, got_w = route_triton(logits, router, k, b, norm_topk=norm, scaling=scaling)
    want_e, want_w = route_ref(logits, router, k, b, norm_topk=norm, scaling=scaling)
    assert got_e.dtype == torch.int64 and got_e.shape == got_w.shape == (9, k)
    order_got, order_want = got_e.argsort(dim=-1), want_e.argsort(dim=-1)  # (the same experts, matched)
    assert torch.equal(got_e.gather(1, order_got), want_e.gather(1, order_want))
    assert torch.allclose(got_w.gather(1, order_got), want_w.gather(1, order_want), rtol=1e-6, atol=1e-7)
    if router != "sigmoid":  # (transformers' sigmoid router takes its picks unsorted)
        assert torch.equal(got_e, want_e)
    if bias:  # the bias moves the choice, not the weights: without it other experts win
        assert not torch.equal(route_ref(logits, router, k, None)[0].sort().values, want_e.sort().values)


def test_block_scaled_fp8_experts_are_refused_by_name():
    pytest.importorskip("triton")
    from fastmamba.kernels.moe import moe_ffn_triton

    in_w, out_w = experts_case(True, "fp8")
    blocked = Fp8Weight(in_w.data, torch.ones(5, 1, 1), block=(128, 128))
    x, experts, weights = routing(3, 2, 5)
    with pytest.raises(ValueError, match="block scales"):
        moe_ffn_triton(x, experts, weights, blocked, out_w, "silu", True, tiles=TILES)


def tiny_checkpoint(name: str, tmp_path_factory):
    """A tiny Granite-4.0-H, Nemotron-H or Jamba model with experts (tests/test_moe.py's,
    tests/test_jamba.py's)."""
    pytest.importorskip("transformers")
    from test_moe import granite_moe, nemotron_moe, save

    folder = tmp_path_factory.mktemp(name)
    if name == "jamba":
        from test_jamba import jamba
        from test_jamba import save as jamba_save

        jamba_save(jamba(), folder)
    else:
        save(granite_moe("nope", k=2) if name == "granite" else nemotron_moe(k=2, n_group=4, topk_group=2), folder)
    return folder


@pytest.fixture(scope="module", params=["granite", "nemotron"])
def tiny(request, tmp_path_factory):
    return tiny_checkpoint(request.param, tmp_path_factory)


@pytest.mark.parametrize("name", ["granite", "nemotron", "jamba"])
def test_the_sublayer_over_the_gpu_ops_is_the_reference(name, tmp_path_factory):
    """moe.moe over core/ops.triton_ops (the grouped kernel at the plan's MOE_TILES; compiled
    where CUDA is, else in the interpreter) against the reference ops, routed and shared parts
    together."""
    pytest.importorskip("triton")
    from test_hybrids import KERNELS_ON as device

    import fastmamba
    from fastmamba.core.ops import triton_ops
    from fastmamba.engine.plan import KERNEL_TILES

    model = fastmamba.load(tiny_checkpoint(name, tmp_path_factory), device=device).model
    c = model.config
    lw = model.weights.layers[c.kinds.index("moe")]
    u = torch.randn(2, 11, c.d_model, generator=torch.Generator().manual_seed(3)).to(device)
    got = moe.moe(c, lw, u, triton_ops(KERNEL_TILES))
    assert relative_error(got, moe.moe(c, lw, u, REFERENCE_OPS)) < 1e-5


@pytest.mark.parametrize("name", ["granite", "nemotron", "jamba"])
def test_the_gpu_ops_decode_the_model_as_the_reference_does(name, tmp_path_factory):
    """The whole model over the GPU ops (Triton's interpreter without CUDA): a prefill and
    decode steps, as the GPU engine's layer-ops step runs them, give the reference's logits."""
    pytest.importorskip("triton")
    from test_hybrids import assert_the_gpu_ops_decode_it_as_the_reference_does

    assert_the_gpu_ops_decode_it_as_the_reference_does(tiny_checkpoint(name, tmp_path_factory))


# -- on the GPU ----------------------------------------------------------------------------------


@pytest.mark.gpu
def test_the_gpu_engine_runs_the_model_as_the_cpu_does(tiny):
    """Loaded on CUDA, a model with experts runs on the GPU engine (its decode steps in CUDA
    graphs, the experts through the fused kernel): the CPU's logits, greedy tokens, a batch's
    tokens; bf16 within 1.5x transformers' own error (tests/test_hybrids.py's check)."""
    from test_hybrids import assert_the_gpu_engine_runs_it_as_the_cpu_does

    assert_the_gpu_engine_runs_it_as_the_cpu_does(tiny)


def gpu_model(folder, dtype="float32"):
    """The checkpoint's model on CUDA's default engine, the GPU one: its MoE sublayers through
    the fused kernel."""
    import fastmamba

    lm = fastmamba.load(folder, device="cuda", dtype=dtype)
    assert lm.engine == "triton"
    return lm.model


@pytest.mark.gpu
def test_on_the_gpu_the_fused_kernel_runs_the_model_as_the_cpu_reference(tiny):
    from test_hybrids import ids

    import fastmamba

    x = ids(2, 33, seed=5)
    want = fastmamba.load(tiny).forward(x)
    assert relative_error(gpu_model(tiny).forward(x.cuda()), want) < 1e-4
    assert_within_transformers_16bit_error(gpu_model(tiny, "bfloat16").forward(x.cuda()), tiny, x, "bfloat16")
    # FP8: the GPU ops' products round the activations too (the experts' to bfloat16, the rest
    # to e4m3), so against float32 within tests/test_fp8_kernels.py's bound of the reference
    # FP8 engine's error (float32 activations)
    ref_err = relative_error(fastmamba.load(tiny, dtype="fp8").forward(x), want)
    assert relative_error(gpu_model(tiny, "fp8").forward(x.cuda()), want) <= 2.5 * ref_err


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, "fp8"], ids=["float32", "bfloat16", "fp8"])
@pytest.mark.parametrize("act,gated", FAMILIES, ids=["gated_silu", "squared_relu"])
@pytest.mark.parametrize("tiles", ["few", "many"])
def test_on_the_gpu_a_token_is_the_same_bits_alone_and_in_any_batch(dtype, act, gated, tiles):
    """At each of the plan's tile sets, on the tensor cores: a token's routed output does not
    depend on which tokens share its experts or how many there are (given its routing)."""
    from fastmamba.engine.plan import MOE_TILES
    from fastmamba.kernels.moe import moe_ffn_triton

    one_set = getattr(MOE_TILES, tiles)  # (one MoETiles: the launch would pick its set by the count)

    in_w, out_w = experts_case(gated, dtype, E=8, d=512, I=256)
    in_w, out_w = ((w.to("cuda") if isinstance(w, Fp8Weight) else w.cuda()) for w in (in_w, out_w))
    x, experts, weights = (t.cuda() for t in routing(300, 2, 8, d=512))
    together = moe_ffn_triton(x, experts, weights, in_w, out_w, act, gated, tiles=one_set)
    want = moe_ffn_ref(x, experts, weights, in_w, out_w, act, gated, linear=rounded_linear)
    # (the hidden activations may round to the other neighbour where the sums' order differs)
    assert relative_error(together, want) < (1e-5 if dtype == torch.float32 else 2e-3)
    for n in (1, 5, 64, 129):
        part = moe_ffn_triton(x[:n], experts[:n], weights[:n], in_w, out_w, act, gated, tiles=one_set)
        assert torch.equal(part, together[:n]), n
    alone = moe_ffn_triton(x[-1:], experts[-1:], weights[-1:], in_w, out_w, act, gated, tiles=one_set)
    assert torch.equal(alone[0], together[-1])
