"""FP8 weights on the GPU engine (kernels/fp8_gemm.py): the decode kernels that read the e4m3
bytes against their `_ref` twins and core/fp8.py's reference product, fp8_linear's arithmetic,
the plan's FP8 rows, the load-time memory refusal; and, on a GPU (`gpu` tests), the whole FP8
engine with CUDA graphs against the reference engine.

Without CUDA the kernels run in Triton's interpreter (TRITON_INTERPRET=1, set in conftest
before triton is imported), at the tiny shapes of the test checkpoints.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from conftest import relative_error as rel_err

import fastmamba
from fastmamba.core import fp8
from fastmamba.core.fp8 import FP8, quantize
from fastmamba.engine.decode_step import make_decode_step
from fastmamba.engine.plan import DecodePlan, one_row_blocks, plan_for

pytest.importorskip("triton")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# The one-row kernels multiply the e4m3 values in float32 as the reference does, the scales
# on the sums: only the order of the sums differs.
ONE_ROW_TOL = 1e-4
# With the products on the tensor cores (OneRowBlocks.in_proj_mma, out_proj_mma) the row is
# rounded to f16 (2^-11 relative) for them.
MMA_TOL = 2e-3
# The products step rounds each product's operand once to bfloat16 (2^-9 relative), as the
# 16-bit engine does.
BF16_OPERAND_TOL = 2e-2
# The one-row step on a GPU against the CPU reference's: the embedding's rows (and a tied
# head) in bfloat16 there (dtypes.embedding_dtype), float32 here. Measured on an H100: 2.7e-3
# to 3.4e-3 with a float32 embedding, 1.0e-2 to 1.7e-2 with the bfloat16 one.
GPU_ONE_ROW_TOL = 3e-2
# Prefill quantizes each token's activations to e4m3 too (fp8_linear): a second e4m3 rounding
# beside the weights', so its error against float32 may be up to this many times the
# reference FP8 engine's (float32 activations); measured 1.1x to 1.6x on the tiny models.
ACTIVATIONS_OVER_WEIGHTS = 2.5


def rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE)


@pytest.fixture(scope="module")
def fp8_models(checkpoints):
    """The tiny checkpoints in FP8 on the test's device, on the reference engine (whose
    `step` is the oracle; the decode steps under test take its weights)."""
    return {name: fastmamba.load(checkpoints[name], device=DEVICE, dtype="fp8", engine="reference").model
            for name in ("untied_bias_rank", "kernel3_state8", "odd_vocab_tied")}


# -- the products (kernels/products.py, kernels/fp8_gemm.py) -----------------------------------


@pytest.mark.parametrize("operand", ["bfloat16", "float32"])
@pytest.mark.parametrize("M,N,K,splits", [(1, 40, 24, 1), (5, 33, 100, 3), (20, 48, 64, 2)])
def test_invariant_gemm_reads_fp8(operand, M, N, K, splits):
    """invariant_gemm over e4m3 values with row scales: its chunks add up to the reference
    product (core/fp8.linear) of the same operand, the scales on each chunk's sums."""
    from fastmamba.kernels import products as gm

    w = quantize(rand(N, K, seed=1) * torch.logspace(-2, 1, N, device=DEVICE)[:, None])
    a = rand(M, K, seed=2).to(getattr(torch, operand))
    S = gm.split_count(K, splits)
    out = torch.full((S * M, N), float("nan"), device=DEVICE)
    gm.invariant_gemm(a, w.data, out, splits, scale=w.scale)
    got = out.view(S, M, N).sum(0)
    assert rel_err(got, gm.invariant_gemm_ref(a, w.data, w.scale)) < 1e-5
    assert rel_err(got, fp8.linear(a.float(), w)) < 1e-5
    with pytest.raises(AssertionError, match="scales"):
        gm.invariant_gemm(a, w.data, out, splits)


def test_fp8_linear_reference_against_the_dequantized_product():
    """fp8_linear's arithmetic (its twin; what it computes on the CPU): the activations
    quantized a row to e4m3 (amax / 448), times the e4m3 weight, both scales on the sums.
    Exactly core/fp8.linear of the quantized activations; within e4m3's rounding of the
    activations of the dequantized product; a zero row stays zero."""
    from fastmamba.core.fp8 import E4M3_MAX
    from fastmamba.kernels.fp8_gemm import fp8_linear, fp8_linear_ref, fp8_linear_triton, quantize_rows

    x = rand(3, 5, 64, seed=3) * torch.logspace(-3, 2, 5, device=DEVICE)[:, None]  # rows of many magnitudes
    x[1, 2] = 0
    w = quantize(rand(48, 64, seed=4))
    bias = rand(48, seed=5)
    y = fp8_linear_ref(x, w.data, w.scale, bias)
    assert y.shape == (3, 5, 48) and y.dtype == torch.float32
    xq, sx = quantize_rows(x.reshape(-1, 64))
    assert torch.equal(sx[:, 0], torch.where(x.abs().amax(-1) > 0, x.abs().amax(-1) / E4M3_MAX, 1.0).flatten())
    assert rel_err(y, fp8.linear(fp8.values(xq) * sx, w, bias).view(3, 5, 48)) < 1e-6
    assert rel_err(y, F.linear(x, w.dequantize(), bias)) < 0.03  # e4m3 keeps 4 significant bits
    assert torch.equal(y[1, 2], bias)
    if DEVICE == "cpu":  # (on the GPU: test_fp8_linear_on_the_gpu)
        assert torch.equal(fp8_linear(x, w.data, w.scale, bias), y)
    # the path for shapes cuBLASLt does not take: products.py's GEMM, the same arithmetic
    got = fp8_linear_triton(xq, sx, w.data, w.scale) + bias
    assert rel_err(got, y.view(-1, 48)) < 1e-5


# -- the one-row step (kernels/decode_step.py) --------------------------------------------------


@pytest.mark.parametrize("fused,mma", [(True, False), (False, False), (True, True)],
                         ids=["fused", "conv-kernel", "fused-mma"])
@pytest.mark.parametrize("name,batch", [("untied_bias_rank", 2), ("odd_vocab_tied", 3)])
def test_one_row_step_reads_fp8(fp8_models, name, batch, fused, mma):
    """Whole one-row steps (in_proj with the conv step and x_proj in its programs, or in a
    kernel of their own; in_proj's and out_proj's products on the tensor cores or not;
    dt_proj in ssm_step; out_proj split over K; an FP8 head, untied, or the float32
    embedding, tied) against the reference engine's FP8 step."""
    model = fp8_models[name]
    c = model.config
    blocks = one_row_blocks(c.d_model, c.d_inner, c.vocab_size, FP8)
    if mma:  # (16 rows a program at least: the tensor cores' smallest tile)
        blocks = dataclasses.replace(blocks, in_proj=(16, *blocks.in_proj[1:]), out_proj=(16, *blocks.out_proj[1:]),
                                     in_proj_mma=True, out_proj_mma=True)
    step = make_decode_step(model, batch, plan=DecodePlan("one-row", blocks=blocks))
    step.fused_conv = fused
    tol = MMA_TOL if mma else ONE_ROW_TOL
    state = model.new_state(batch)
    state.conv.copy_(rand(*state.conv.shape, seed=10))
    state.ssm.copy_(rand(*state.ssm.shape, seed=11))
    ref_state = fastmamba.MambaState(state.conv.clone(), state.ssm.clone())
    for t in range(2):
        tokens = torch.randint(0, model.config.vocab_size, (batch,), device=DEVICE)
        assert rel_err(step(tokens, state), model.step(tokens, ref_state)) < tol
    assert rel_err(state.ssm, ref_state.ssm) < tol and rel_err(state.conv, ref_state.conv) < tol


def test_one_row_kernels_equal_their_twins_in_fp8(fp8_models):
    """The kernels one at a time against their `_ref` twins given the Fp8Weights (the twins'
    product: fp8_gemm.linear_ref, the scales on the sums)."""
    from fastmamba.kernels import decode_step as ds
    from fastmamba.kernels import gemv

    model = fp8_models["untied_bias_rank"]
    c, w, B = model.config, model.weights, 2
    lw = w.layers[0]
    assert isinstance(lw.in_proj_w, fp8.Fp8Weight) and isinstance(w.lm_head, fp8.Fp8Weight)
    step = make_decode_step(model, B, plan=DecodePlan("one-row"))
    h = rand(B, c.d_model, seed=20)
    step.h[:B], step.dh[:B] = h, 0
    step.lm_head()
    assert rel_err(step.logits[:B], ds.rmsnorm_linear_ref(h, w.norm_f, c.norm_eps, w.lm_head)) < ONE_ROW_TOL
    # ssm_step: dt_proj's FP8 product from dbc (fixed point), the state update
    R, N, E = c.dt_rank, c.d_state, c.d_inner
    dbc = rand(B, R + 2 * N, seed=21)
    step.dbc.zero_()
    step.dbc[:, : R + 2 * N] = gemv.to_fixed(dbc)
    xc, z = rand(B, E, seed=22), rand(B, E, seed=23)
    step.xc[:B], step.xz[:B, E:] = xc, z
    ssm = rand(B, E, N, seed=24)
    ssm_ref = ssm.clone()
    step.ssm_step(lw, ssm)
    y_ref = ds.ssm_step_ref(gemv.from_fixed(gemv.to_fixed(dbc)), xc, z, ssm_ref, lw.dt_proj_w, lw.dt_bias, lw.A, lw.D)
    assert rel_err(step.y[:B], y_ref) < ONE_ROW_TOL and rel_err(ssm, ssm_ref) < ONE_ROW_TOL
    # out_proj: its K splits' FP8 sums meet in dh
    step.dh.zero_()
    step.out_proj_residual(lw)
    got = gemv.from_fixed(step.dh[:B])
    want = ds.out_proj_residual_ref(step.y[:B], lw.out_proj_w, lw.out_proj_b, torch.zeros_like(got))
    assert rel_err(got, want) < ONE_ROW_TOL


# -- the products step (kernels/decode_gemm.py) -------------------------------------------------


@pytest.mark.parametrize("name,batch", [("untied_bias_rank", 5), ("kernel3_state8", 4), ("odd_vocab_tied", 6)])
def test_products_step_reads_fp8(fp8_models, name, batch):
    """The products step over FP8 weights (the plan's at these batches; the deterministic
    one at every batch): the Triton products read the e4m3 bytes beside bfloat16 operands
    (a tied head: its float32 operand); against the reference engine's FP8 step within
    bfloat16 operands' rounding."""
    from fastmamba.kernels.decode_gemm import GemmDecodeStep

    model = fp8_models[name]
    step = make_decode_step(model, batch, deterministic=True)
    assert isinstance(step, GemmDecodeStep) and not step.cublas_products and step.u.dtype == torch.bfloat16
    assert step.u_head.dtype == (torch.float32 if model.config.tie_embeddings else torch.bfloat16)
    state = model.new_state(batch)
    state.ssm.copy_(rand(*state.ssm.shape, seed=12))
    ref_state = fastmamba.MambaState(state.conv.clone(), state.ssm.clone())
    for _ in range(2):
        tokens = torch.randint(0, model.config.vocab_size, (batch,), device=DEVICE)
        assert rel_err(step(tokens, state), model.step(tokens, ref_state)) < BF16_OPERAND_TOL
    assert rel_err(state.ssm, ref_state.ssm) < BF16_OPERAND_TOL


def test_products_step_with_cublas_products_in_fp8(checkpoints):
    """A products plan naming cuBLAS products takes FP8 weights through fp8_linear (the
    activations quantized a row, cuBLASLt's FP8 GEMM on a GPU): logits against float32
    within ACTIVATIONS_OVER_WEIGHTS of the reference FP8 engine's error, over whole steps."""
    from fastmamba.engine.plan import ALL, IN_OUT_PROJ, IN_PROJ

    folder = checkpoints["untied_bias_rank"]
    ref = fastmamba.load(folder, device=DEVICE, dtype="fp8", engine="reference").model
    f32 = fastmamba.load(folder, device=DEVICE, engine="reference").model
    B = 4
    ids = torch.randint(0, ref.config.vocab_size, (B, 5), generator=torch.Generator().manual_seed(4)).to(DEVICE)
    for cublas in (IN_PROJ, IN_OUT_PROJ, ALL):  # (the plan's rows past 64, and all)
        step = make_decode_step(ref, B, plan=DecodePlan("products", cublas))
        assert step.cublas_products == set(cublas)
        states = {k: m.new_state(B) for k, m in (("ours", ref), ("ref", ref), ("f32", f32))}
        for t in range(5):
            want = f32.step(ids[:, t], states["f32"])
            err = rel_err(step(ids[:, t], states["ours"]), want)
            ref_err = rel_err(ref.step(ids[:, t], states["ref"]), want)
            assert err <= ACTIVATIONS_OVER_WEIGHTS * ref_err, (sorted(cublas), t, err, ref_err)


# -- the plan (engine/plan.py) ------------------------------------------------------------------


def test_the_tensor_core_products_need_16_rows_a_program(fp8_models):
    model = fp8_models["untied_bias_rank"]
    c = model.config
    blocks = one_row_blocks(c.d_model, c.d_inner, c.vocab_size, FP8)
    for name in ("in_proj", "out_proj"):
        narrow = dataclasses.replace(blocks, **{name: (8, *getattr(blocks, name)[1:]), f"{name}_mma": True})
        with pytest.raises(ValueError, match=f"OneRowBlocks.{name}_mma needs 16 or more rows a program, got {name} 8"):
            make_decode_step(model, 1, plan=DecodePlan("one-row", blocks=narrow))
    # a hybrid's experts' products on the same flags, in tiles of their own
    wide = dataclasses.replace(blocks, in_proj=(16, *blocks.in_proj[1:]), out_proj=(16, *blocks.out_proj[1:]))
    for flag, name, tile in (("in_proj", "moe_in", (8, 256, 4)), ("out_proj", "moe_out", (8, 256, 4, 640))):
        narrow = dataclasses.replace(wide, **{name: tile, f"{flag}_mma": True})
        with pytest.raises(ValueError, match=f"OneRowBlocks.{flag}_mma needs 16 or more rows a program, got {name} 8"):
            make_decode_step(model, 1, plan=DecodePlan("one-row", blocks=narrow))


def test_the_plan_has_fp8_rows_for_every_batch(fp8_models):
    """Every batch size has an FP8 row: the one-row step at a few rows, else the all-Triton
    products, but past 64 rows at widths over 1024 in_proj and out_proj on cuBLASLt's FP8
    GEMM (timed on an H100; the rest untuned); make_decode_step builds them; a slot is
    bitwise the same within each range of one family (plan.batch_invariant_ranges)."""
    from fastmamba.engine.plan import batch_invariant_ranges
    from fastmamba.kernels.decode_gemm import GemmDecodeStep
    from fastmamba.kernels.decode_step import DecodeStep

    model = fp8_models["kernel3_state8"]
    assert model.weights.dtype == FP8
    for d_model in (64, 768, 1024, 2560, 4096):
        config = dataclasses.replace(model.config, d_model=d_model)
        for batch in (1, 2, 3, 4, 5, 32, 64, 65, 128, 256, 1024):
            plan = plan_for(config, FP8, batch)
            assert plan.step in ("one-row", "products")
            large = frozenset({"in_proj", "out_proj"})
            assert plan.cublas == (large if d_model > 1024 and batch > 64 else frozenset()), (d_model, batch)
            assert ("untuned" in plan.reason) == (d_model <= 1024 or batch <= 2), (d_model, batch)
        ranges = batch_invariant_ranges(d_model, FP8, 512)
        assert ranges[-1][1] == (64 if d_model > 1024 else 512)
    assert isinstance(make_decode_step(model, 1), DecodeStep)
    assert isinstance(make_decode_step(model, 64), GemmDecodeStep)


@pytest.mark.parametrize("before,mma", [(False, False), (True, False), (False, True)])
def test_fp8_mamba2_one_row_step(tmp_path, before, mma):
    """FP8 Mamba-2's one-row step (kernels/decode_step_mamba2.py: in_proj and the head
    through decode_step.py's kernel, out_proj in gated_out_proj, each reading the e4m3
    bytes, their products on the tensor cores or not) against the reference engine's FP8
    steps from the same state; the plan's FP8 Mamba-2 rows: one-row at a few rows, the layer
    over the GPU ops past them."""
    from test_mamba2 import save_mamba2

    from fastmamba.kernels.decode_step_mamba2 import Mamba2DecodeStep

    folder, _ = save_mamba2(tmp_path / "m", n_groups=2, use_bias=True)
    loaded = fastmamba.load(folder, device=DEVICE, dtype="fp8", engine="reference").model
    model = type(loaded)(dataclasses.replace(loaded.config, norm_before_gate=before), loaded.weights)
    assert plan_for(model.config, FP8, 1).step == "one-row" and plan_for(model.config, FP8, 8).step == "layer-ops"
    assert plan_for(model.config, FP8, 1, deterministic=True).step == "layer-ops"
    B = 3
    c = model.config
    blocks = one_row_blocks(c.d_model, c.d_inner, c.vocab_size, FP8, "mamba2")
    if mma:  # (16 rows a program at least: the tensor cores' smallest tile)
        blocks = dataclasses.replace(blocks, out_proj=(16, *blocks.out_proj[1:]), in_proj_mma=True, out_proj_mma=True)
    step = make_decode_step(model, B, plan=DecodePlan("one-row", blocks=blocks))
    assert isinstance(step, Mamba2DecodeStep)
    tol = MMA_TOL if mma else ONE_ROW_TOL
    state = model.new_state(B)
    ids = torch.randint(0, 97, (B, 12), generator=torch.Generator().manual_seed(2)).to(DEVICE)
    model.prefill(ids[:, :7], state, last_only=True)
    ref_state = fastmamba.MambaState(state.conv.clone(), state.ssm.clone())
    for t in range(7, 12):
        assert rel_err(step(ids[:, t], state), model.step(ids[:, t], ref_state)) < tol
    assert rel_err(state.ssm, ref_state.ssm) < tol and rel_err(state.conv, ref_state.conv) < tol


# -- the GPU ops' prefill (core/ops.triton_ops) --------------------------------------------------


def test_the_gpu_ops_prefill_fp8(checkpoints):
    """The model over the GPU ops with FP8 weights (Triton conv and scan; the products
    fp8_linear: cuBLASLt's on a GPU, its reference arithmetic on the CPU; the activations the layers ask in
    "FP8" written in bfloat16): its logits against float32 within ACTIVATIONS_OVER_WEIGHTS
    of the reference FP8 engine's error; the training ops refuse FP8 weights."""
    from fastmamba.core.model import Mamba
    from fastmamba.core.ops import triton_ops
    from fastmamba.engine.plan import KERNEL_TILES

    folder = checkpoints["kernel3_state8"]
    ref = fastmamba.load(folder, device=DEVICE, dtype="fp8", engine="reference").model
    f32 = fastmamba.load(folder, device=DEVICE, engine="reference").model
    ours = Mamba(ref.config, ref.weights, triton_ops(KERNEL_TILES))
    ids = torch.randint(0, ref.config.vocab_size, (2, 19), generator=torch.Generator().manual_seed(7)).to(DEVICE)
    want = f32.forward(ids)
    err, ref_err = rel_err(ours.forward(ids), want), rel_err(ref.forward(ids), want)
    assert err <= ACTIVATIONS_OVER_WEIGHTS * ref_err, (err, ref_err)
    with pytest.raises(ValueError, match="fp8 weights run on the reference ops or the GPU's"):
        Mamba(ref.config, ref.weights, dataclasses.replace(triton_ops(KERNEL_TILES), fp8=False))


# -- memory at load (engine/memory.py) -----------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "fp8"])
def test_weights_bytes_are_what_the_loader_allocates(dtype):
    """memory.weights_bytes from config.json alone equals the bytes the loaded weights hold."""
    from fastmamba.core.dtypes import parse_dtype
    from fastmamba.core.fp8 import nbytes
    from fastmamba.engine.memory import weights_bytes

    lm = fastmamba.load(dtype=dtype)
    w = lm.model.weights
    held = [w.embedding, w.norm_f] + ([] if lm.config.tie_embeddings else [w.lm_head])
    held += [t for lw in w.layers for t in vars(lw).values() if t is not None]
    need, moment = weights_bytes(lm.config, parse_dtype(dtype), lm.model.device)
    assert need == sum(nbytes(t) for t in held)
    assert moment > 0


def test_a_model_too_large_is_refused_before_any_weight_is_allocated(tmp_path, monkeypatch):
    """On CUDA, load compares the weights' bytes (from config.json: mamba-2.8b's here, no
    weights written) with the free memory before the checkpoint is read: too little is a
    CheckpointError naming both and, where FP8 would fit, --dtype fp8; enough passes. The
    device check and the free-memory query are stood in for."""
    import json

    import fastmamba.engine.loader as loader
    from fastmamba.bench import SHAPES
    from fastmamba.engine import memory

    (tmp_path / "config.json").write_text(json.dumps(SHAPES["2.8b"].to_hf_dict()))
    config = SHAPES["2.8b"]
    need = {d: sum(memory.weights_bytes(config, d)) for d in (torch.bfloat16, FP8)}
    assert 5.3e9 < need[torch.bfloat16] < 6.0e9 and 2.9e9 < need[FP8] < 3.9e9  # (a float32 embedding: 0.5 GB)
    cuda = torch.device("cuda")
    memory.check_weights_fit(tmp_path, torch.bfloat16, cuda, free=need[torch.bfloat16])  # fits exactly
    with pytest.raises(fastmamba.CheckpointError) as info:
        memory.check_weights_fit(tmp_path, torch.bfloat16, cuda, free=need[FP8])
    msg = str(info.value)
    assert str(tmp_path) in msg and "bfloat16" in msg and f"({need[FP8]} bytes) free" in msg and "--dtype fp8" in msg
    with pytest.raises(fastmamba.CheckpointError) as info:
        memory.check_weights_fit(tmp_path, FP8, cuda, free=need[FP8] - 1)
    assert "--dtype fp8" not in str(info.value)

    def never(*a, **k):
        raise AssertionError("the checkpoint's weights were read")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (need[FP8], 80 << 30))
    monkeypatch.setattr(loader, "load_checkpoint", never)
    with pytest.raises(fastmamba.CheckpointError, match="--dtype fp8"):
        fastmamba.load(tmp_path, device="cuda", dtype="bfloat16")
    with pytest.raises(AssertionError, match="weights were read"):  # FP8 fits: on to the checkpoint
        fastmamba.load(tmp_path, device="cuda", dtype="fp8")


# -- the whole FP8 engine on a GPU ---------------------------------------------------------------


@pytest.fixture(scope="module")
def wide_ckpt(tmp_path_factory):
    """Two layers at mamba-130m's widths (d 768, E 1536, dt_rank 48), an untied head of an
    odd vocabulary (not a multiple of 16: its prefill product takes fp8_linear's Triton path)."""
    from conftest import save_hf_checkpoint

    return save_hf_checkpoint(tmp_path_factory.mktemp("fp8gpu") / "m", seed=5, hidden_size=768, num_hidden_layers=2,
                              vocab_size=50277, tie_word_embeddings=False)


def graph_steps(step, state, ids: torch.Tensor) -> torch.Tensor:
    """The step captured in a CUDA graph and replayed over ids (B, T) from `state`: logits
    (B, T, V) on the CPU. Eager calls first (compiling, on a copy of the state)."""
    B = ids.shape[0]
    tokens = ids[:, 0].cuda().contiguous()
    scratch = type(state)(state.conv.clone(), state.ssm.clone())
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step(tokens, scratch)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        logits = step(tokens, state)
    out = []
    for t in range(ids.shape[1]):
        tokens.copy_(ids[:, t])
        graph.replay()
        out.append(logits[:B].cpu())
    return torch.stack(out, 1)


@pytest.mark.gpu
@pytest.mark.parametrize("B,deterministic", [(1, False), (2, False), (6, False), (40, False), (3, True)])
def test_fp8_decode_steps_in_cuda_graphs_match_the_reference(wide_ckpt, B, deterministic):
    """The plan's step for FP8 weights (one-row at 1-2 rows, the Triton products from 3),
    captured in a CUDA graph, from the reference engine's state after the same prompt: its
    error against the float32 model's steps within ACTIVATIONS_OVER_WEIGHTS of the reference
    FP8 engine's own; one-row's steps within GPU_ONE_ROW_TOL of the reference's. (The GPU
    reads the embedding, a tied head and the products' operands in bfloat16 under fp8:
    dtypes.embedding_dtype; the CPU reference keeps float32.)"""
    gpu = fastmamba.load(wide_ckpt, device="cuda", dtype="fp8").model
    cpu = fastmamba.load(wide_ckpt, dtype="fp8").model
    f32 = fastmamba.load(wide_ckpt).model
    assert gpu.ops.fp8 and gpu.weights.dtype == FP8 and gpu.weights.embedding.dtype == torch.bfloat16
    ids = torch.randint(0, 50277, (B, 16), generator=torch.Generator().manual_seed(B))
    cpu_state, f32_state = cpu.new_state(B), f32.new_state(B)
    cpu.prefill(ids[:, :8], cpu_state, last_only=True)
    f32.prefill(ids[:, :8], f32_state, last_only=True)
    gpu_state = gpu.new_state(B)
    gpu_state.conv.copy_(cpu_state.conv)
    gpu_state.ssm.copy_(cpu_state.ssm)
    step = make_decode_step(gpu, B, deterministic)
    got = graph_steps(step, gpu_state, ids[:, 8:])
    want = torch.stack([cpu.step(ids[:, t], cpu_state) for t in range(8, 16)], 1)
    exact = torch.stack([f32.step(ids[:, t], f32_state) for t in range(8, 16)], 1)
    err, ref_err = rel_err(got, exact), rel_err(want, exact)
    assert err <= ACTIVATIONS_OVER_WEIGHTS * ref_err, (step.plan.step, err, ref_err)
    if step.plan.step == "one-row":
        assert rel_err(got, want) < GPU_ONE_ROW_TOL, rel_err(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("K,block", [(64, 1024), (100, 32)])
def test_the_quantize_kernel_is_bitwise_the_reference(dtype, K, block):
    """quantize_rows_triton (one kernel: a row's amax, then its scaled e4m3 values) gives the
    torch reference's bits: rows of many magnitudes, a zero row, values at the rounding
    ties of e4m3 and past 448 times the scale, a row longer than a block (K 100, block 32),
    a transposed (strided) input."""
    from fastmamba.kernels.fp8_gemm import quantize_rows_ref, quantize_rows_triton

    x = rand(7, K, seed=11) * torch.logspace(-4, 3, 7, device=DEVICE)[:, None]
    x[2] = 0
    x[3, :8] = torch.tensor([448.0, -448.0, 1.0625, 1.1875, -2.125, 0.0, 3.75, 1e-9]) * 3  # (ties: e4m3 keeps 3 bits)
    x = x.to(dtype)
    for given in (x, x.t().contiguous().t()):
        q, s = quantize_rows_triton(given, block=block)
        want_q, want_s = quantize_rows_ref(given)
        assert torch.equal(s, want_s)
        assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))


@pytest.mark.gpu
def test_fp8_linear_on_the_gpu():
    """fp8_linear on CUDA: torch._scaled_mm (shapes of multiples of 16; its output rounded
    to bfloat16) and the Triton path (an odd side) against its reference arithmetic; and it
    captures in a CUDA graph."""
    from fastmamba.kernels.fp8_gemm import fp8_linear, fp8_linear_ref

    for N, K in ((256, 128), (50277, 64), (48, 40)):
        w = quantize(rand(N, K, seed=1))
        x = rand(2, 37, K, seed=2)
        bias = rand(N, seed=3)
        got = fp8_linear(x, w.data, w.scale, bias)
        assert got.shape == (2, 37, N) and got.dtype == torch.float32
        assert rel_err(got, fp8_linear_ref(x, w.data, w.scale, bias)) < 1e-2, (N, K)
    graph = torch.cuda.CUDAGraph()
    w = quantize(rand(256, 128, seed=1))
    x = rand(8, 128, seed=2)
    fp8_linear(x, w.data, w.scale)
    with torch.cuda.graph(graph):
        y = fp8_linear(x, w.data, w.scale)
    x.copy_(rand(8, 128, seed=9))
    graph.replay()
    assert rel_err(y, fp8_linear_ref(x, w.data, w.scale)) < 1e-2


def _engine_folder(tmp_path, wide_ckpt, kind: str):
    """A checkpoint folder of each kind the FP8 engine runs: Mamba-1 (wide_ckpt), Mamba-2,
    and a Nemotron-H hybrid."""
    if kind == "mamba1":
        return wide_ckpt
    if kind == "mamba2":
        from test_mamba2 import save_mamba2

        return save_mamba2(tmp_path / "m2", hidden_size=256, head_dim=32, num_heads=16)[0]
    from test_fp8 import tiny_hybrid

    tiny_hybrid("nemotron_h", tmp_path / "h")
    return tmp_path / "h"


def greedy_tokens(lm, prompts, steps: int = 6):
    """Each prompt's greedy tokens through the public path (the engine's prefill, graph-captured
    where its plan says, and its CUDA-graph decode steps)."""
    from fastmamba.core.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=steps, temperature=0.0, stop_token_ids=[])
    return [g.token_ids for g in lm.generate_batch(prompts, params)]


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["mamba1", "mamba2", "hybrid"])
def test_the_fp8_engine_against_the_reference(tmp_path, wide_ckpt, kind):
    """The whole FP8 engine on a GPU (engine 'triton': prefill through fp8_linear, decode
    steps in CUDA graphs): its prefill logits against float32 within ACTIVATIONS_OVER_WEIGHTS
    of the reference FP8 engine's own error; generation runs through the graphs; in
    deterministic mode a batch of prompts decodes as each alone, bitwise."""
    folder = _engine_folder(tmp_path, wide_ckpt, kind)
    lm = fastmamba.load(folder, device="cuda", dtype="fp8")
    assert lm.engine == "triton"
    ref, f32 = fastmamba.load(folder, dtype="fp8").model, fastmamba.load(folder).model
    V = ref.config.vocab_size
    ids = torch.randint(0, min(V, 160), (2, 40), generator=torch.Generator().manual_seed(1))
    want = f32.forward(ids)
    got = lm.model.forward(ids.cuda()).cpu()
    err, ref_err = rel_err(got, want), rel_err(ref.forward(ids), want)
    assert err <= ACTIVATIONS_OVER_WEIGHTS * ref_err, (err, ref_err)
    prompts = [ids[0, :30].tolist(), ids[1, :17].tolist(), ids[0, 5:12].tolist()]
    assert all(len(t) == 6 for t in greedy_tokens(lm, prompts))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "fp8"])
@pytest.mark.parametrize("kind", ["mamba1", "mamba2", "hybrid"])
def test_deterministic_batches_decode_as_each_prompt_alone(tmp_path, wide_ckpt, kind, dtype):
    """Deterministic mode on a GPU: a batch of prompts decodes (greedy) as each alone,
    bitwise, in bfloat16 and in FP8 (bfloat16 beside it tells a hybrid's fault from FP8's)."""
    folder = _engine_folder(tmp_path, wide_ckpt, kind)
    V = fastmamba.load(folder, dtype="fp8").config.vocab_size
    ids = torch.randint(0, min(V, 160), (2, 40), generator=torch.Generator().manual_seed(1))
    prompts = [ids[0, :30].tolist(), ids[1, :17].tolist(), ids[0, 5:12].tolist()]
    det = fastmamba.load(folder, device="cuda", dtype=dtype, deterministic=True)
    together = greedy_tokens(det, prompts)
    assert together == [greedy_tokens(det, [p])[0] for p in prompts]
