"""Every Triton kernel against its `_ref` twin.

Without CUDA the kernels run in Triton's interpreter on the CPU (TRITON_INTERPRET=1, set in
conftest before triton is imported), at the tiny shapes of the test checkpoints; with CUDA
they run compiled on the GPU.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import assert_within_transformers_16bit_error

import fastmamba
from fastmamba.engine.decode_step import make_decode_step
from fastmamba.engine.plan import PRODUCTS_BLOCKS, SAMPLER_TILES, DecodePlan, one_row_blocks
from fastmamba.kernels import decode_step as ds
from fastmamba.kernels import gemv

pytest.importorskip("triton")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 2e-2}

CASES = [  # (checkpoint, dtype, batch) of the one-row step (DecodeStep)
    ("odd_vocab_tied", "float32", 3),
    ("untied_bias_rank", "bfloat16", 4),  # biases on, dt_rank 3
    ("kernel3_state8", "float16", 5),
    ("kernel3_state8", "bfloat16", 2),
    ("kernel2_state4_wide", "float32", 1),
    ("kernel2_state4_wide", "float32", 8),
]


def rel_err(a, b) -> float:
    assert torch.isfinite(a).all()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE)


@pytest.fixture(params=CASES, ids=[f"{n}-{d}-B{b}" for n, d, b in CASES])
def case(request, checkpoints):
    name, dtype, batch = request.param
    lm = fastmamba.load(checkpoints[name], device=DEVICE, dtype=dtype)
    step = make_decode_step(lm.model, batch, plan=DecodePlan("one-row"))
    return lm.model, step, TOL[lm.model.weights.embedding.dtype]


def set_residual(step, h, pending):
    """Puts the residual h in the step's buffers as h - pending and pending (an out_proj
    share not yet folded in: dh, fixed point); returns h as the buffers hold it."""
    B = h.shape[0]
    step.dh[:B] = gemv.to_fixed(pending)
    step.h[:B] = h - pending
    return residual(step)


def residual(step):
    """The residual stream as the step's buffers hold it: h + dh."""
    return step.h[: step.B] + gemv.from_fixed(step.dh[: step.B])


def test_embed(case):
    model, step, _ = case
    tokens = torch.randint(0, model.config.vocab_size, (step.B,), device=DEVICE)
    step.dh.fill_(5)
    step.embed(tokens)
    ref = ds.embed_ref(tokens, model.weights.embedding)
    assert torch.equal(step.h[: step.B], ref)
    assert not step.dh[: step.B].any()


@pytest.mark.parametrize(
    "fused,conv_block,k_tile", [(True, None, None), (False, None, None), (False, 16, None), (True, None, 8), (False, None, 8)],
    ids=["fused", "conv-kernel", "conv-kernel-16", "fused-k-tiles", "conv-kernel-k-tiles"],
)
def test_in_proj_with_conv_and_x_proj(case, fused, conv_block, k_tile):
    """in_proj, then the conv step and x_proj: in in_proj's x-half programs, or (wide
    models) in a kernel of their own (16 channels a program: these small models' channels
    then span several programs, whose x_proj shares meet in dbc). k_tile: in_proj walks
    d_model in tiles of 8, as wide models do, where the small ones take it in one tile."""
    model, step, tol = case
    step.fused_conv = fused
    step.BN_conv = conv_block or step.BN_conv
    if k_tile:  # in_proj's (BN, BK, warps, stages), BK narrowed
        BN, _, warps, stages = step.in_proj_blocks
        step.in_proj_blocks = BN, k_tile, warps, stages
    lw, c = model.weights.layers[-1], model.config
    conv_state = rand(step.B, c.d_inner, c.d_conv, seed=3)
    ref_state = conv_state.clone()
    for t in range(2):  # twice: the second step convolves the first's x
        h = set_residual(step, rand(step.B, c.d_model, seed=1 + t) * 3, rand(step.B, c.d_model, seed=12 + t))
        step.dbc.zero_()  # as out_proj_residual leaves it: the splits add into it
        step.in_proj(lw, conv_state)
        xz = ds.rmsnorm_linear_ref(h, lw.norm_w, c.norm_eps, lw.in_proj_w, lw.in_proj_b)
        assert rel_err(step.xz[: step.B], xz) < tol
        xc, dbc = ds.conv_x_proj_ref(step.xz[: step.B, : c.d_inner], ref_state, lw.conv_w, lw.conv_b, lw.x_proj_w)
        assert rel_err(step.xc[: step.B], xc) < 1e-5
        assert rel_err(gemv.from_fixed(step.dbc[: step.B, : step.J]), dbc) < tol
        assert torch.equal(conv_state, ref_state)
    assert not step.dbc[:, step.J :].any()  # nothing past the columns


@pytest.mark.parametrize("k_tile", [None, 8], ids=["as-is", "k-tiles"])
def test_lm_head(case, k_tile):
    """k_tile: lm_head walks d_model in tiles of 8, as wide models do (16-bit weights then
    sum after the loop: OneRowBlocks.lm_head), where the small ones take it in one."""
    model, step, tol = case
    c = model.config
    if k_tile:
        BN, _, warps, stages = step.lm_head_blocks
        step.lm_head_blocks = BN, k_tile, warps, stages
    h = set_residual(step, rand(step.B, c.d_model, seed=1) * 3, rand(step.B, c.d_model, seed=12))
    step.lm_head()
    ref = ds.rmsnorm_linear_ref(h, model.weights.norm_f, c.norm_eps, model.weights.lm_head)
    assert rel_err(step.logits[: step.B], ref) < tol


def test_lm_head_argmax_and_take_argmax(case):
    """Greedy sampling inside the step: lm_head's programs meet in an atomic max of keys,
    take_argmax reads it back. Equal to torch.argmax, ties included (the lower index), and
    the slots advance as sample_greedy advances them."""
    from fastmamba.core.sampling import SlotParams, sample_greedy

    model, step, _ = case
    BN, _, warps, stages = step.lm_head_blocks
    step.lm_head_blocks = BN, 8, warps, stages  # 16-bit weights: summed after the loop (the argmax then reads that sum)
    c, w = model.config, model.weights
    V = c.vocab_size
    h = set_residual(step, rand(step.B, c.d_model, seed=1) * 3, rand(step.B, c.d_model, seed=12))
    logits = ds.rmsnorm_linear_ref(h, w.norm_f, c.norm_eps, w.lm_head)
    # a tie for the top: the best row of lm_head copied to a lower index (row 0's best)
    top = int(logits[0].argmax())
    if top > 0:
        w.lm_head[top // 2] = w.lm_head[top]
    slots, ref_slots = SlotParams.empty(step.B, V, DEVICE), SlotParams.empty(step.B, V, DEVICE)
    for s_ in (slots, ref_slots):
        s_.step.fill_(3)
        s_.seen[:, 5] = True
    tokens = torch.zeros(step.B, dtype=torch.int64, device=DEVICE)
    history = torch.zeros(2, step.B, dtype=torch.int64, device=DEVICE)
    for t in range(2):  # twice: take_argmax empties `best` for the next lm_head
        if t == 1:  # then with the logits' signs flipped (mostly negative keys)
            w.lm_head.neg_()
        step.lm_head(argmax=True)
        step.take_argmax(slots, tokens, history[t])
        expected = sample_greedy(step.logits[: step.B], ref_slots)
        assert torch.equal(tokens, expected) and torch.equal(history[t], expected)
        assert torch.equal(slots.step, ref_slots.step) and torch.equal(slots.seen, ref_slots.seen)
        if t == 0 and top > 0:
            assert tokens[0] == top // 2
    assert (step.best == ds.ARGMAX_EMPTY).all()


def test_ssm_step(case):
    model, step, tol = case
    lw, c = model.weights.layers[0], model.config
    step.dbc[: step.B, : step.J] = gemv.to_fixed(rand(step.B, step.J, seed=4))
    step.xc[: step.B] = rand(step.B, c.d_inner, seed=5)
    step.xz[: step.B] = rand(step.B, 2 * c.d_inner, seed=6)
    ssm_state = rand(step.B, c.d_inner, c.d_state, seed=7)
    ref_state = ssm_state.clone()
    h = set_residual(step, rand(step.B, c.d_model, seed=13), rand(step.B, c.d_model, seed=14))
    step.ssm_step(lw, ssm_state)
    assert torch.equal(step.h[: step.B], h) and not step.dh.any()  # dh folded into h
    z = step.xz[: step.B, c.d_inner :]
    y = ds.ssm_step_ref(gemv.from_fixed(step.dbc[: step.B, : step.J]), step.xc[: step.B], z, ref_state, lw.dt_proj_w, lw.dt_bias, lw.A, lw.D)
    assert rel_err(step.y[: step.B], y) < tol
    assert rel_err(ssm_state, ref_state) < tol


def test_out_proj_residual(case):
    model, step, tol = case
    lw, c = model.weights.layers[0], model.config
    h = set_residual(step, rand(step.B, c.d_model, seed=8), torch.zeros(step.B, c.d_model, device=DEVICE))
    step.y[: step.B] = rand(step.B, c.d_inner, seed=9)
    step.dbc.fill_(7)  # x_proj's accumulator, which this kernel zeroes for the next layer
    for _ in range(2):  # twice: the second adds to the first's pending share
        step.out_proj_residual(lw)
        h = ds.out_proj_residual_ref(step.y[: step.B], lw.out_proj_w, lw.out_proj_b, h)
        assert rel_err(residual(step), h) < tol
    assert not step.dbc[: step.B].any()


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "conv-kernel"])
def test_whole_step_equals_the_reference_model(case, fused):
    model, step, tol = case
    step.fused_conv = fused
    c = model.config
    state = model.new_state(step.B)
    state.conv.copy_(rand(*state.conv.shape, seed=10))
    state.ssm.copy_(rand(*state.ssm.shape, seed=11))
    ref_state = fastmamba.MambaState(state.conv.clone(), state.ssm.clone())
    for t in range(2):  # the second step from the states the first left
        tokens = torch.randint(0, c.vocab_size, (step.B,), device=DEVICE)
        logits = step(tokens, state)
        ref = model.step(tokens, ref_state)
        assert rel_err(logits, ref) < tol
    assert rel_err(state.ssm, ref_state.ssm) < tol


@pytest.mark.parametrize("name,dtype", [("untied_bias_rank", "bfloat16"), ("kernel3_state8", "float16")])
def test_whole_step_with_the_products_on_the_tensor_cores(checkpoints, name, dtype):
    """OneRowBlocks.in_proj_mma and out_proj_mma on 16-bit weights: the row rounded to the
    weights' dtype for the products, as transformers' own 16-bit products round it, so the
    bar is transformers' 16-bit error (and float32 weights keep the multiply-and-sum)."""
    model = fastmamba.load(checkpoints[name], device=DEVICE, dtype=dtype).model
    c, batch = model.config, 2
    blocks = dataclasses.replace(one_row_blocks(c.d_model, c.d_inner, c.vocab_size, model.weights.dtype),
                                 in_proj=(16, 256, 4, 1), out_proj=(16, 256, 4, 64), in_proj_mma=True, out_proj_mma=True)
    step = make_decode_step(model, batch, plan=DecodePlan("one-row", blocks=blocks))
    plain = make_decode_step(model, batch, plan=DecodePlan("one-row"))
    state, plain_state = model.new_state(batch), model.new_state(batch)
    ids = torch.randint(0, c.vocab_size, (batch, 6), generator=torch.Generator().manual_seed(4))
    logits, plain_logits = [], []
    for t in range(ids.shape[1]):
        logits.append(step(ids[:, t].to(DEVICE), state).to("cpu", copy=True))
        plain_logits.append(plain(ids[:, t].to(DEVICE), plain_state).to("cpu", copy=True))
    logits = torch.stack(logits, 1)
    assert 0 < rel_err(logits, torch.stack(plain_logits, 1)) < TOL[model.weights.dtype]  # (the row rounded: not bitwise)
    assert_within_transformers_16bit_error(logits, checkpoints[name], ids, dtype)


@pytest.mark.parametrize(
    "batch,slot,rows,deterministic",
    [(20, 16, [16], True), (70, 3, [9, 3, 40], True), (4, 3, [3], False), (21, 2, list(range(5)), False)],
)
def test_a_slot_is_bitwise_the_same_in_any_batch(checkpoints, batch, slot, rows, deterministic):
    """Deterministic mode: any batch size (70 rows take other product tiles than 1 or 3 on
    the GPU; the interpreter keeps one tiling, see products._tiles). Default: within one of
    plan.batch_invariant_ranges (here 1-4 and 5-32). (The interpreter's
    numpy products may round a row by its place in the tile: 21 rows put slot 2's low half
    where 5 rows do, at row 7 of a 16-row tile.)"""
    model = fastmamba.load(checkpoints["untied_bias_rank"], device=DEVICE, dtype="bfloat16").model
    tokens = torch.randint(0, model.config.vocab_size, (batch,), device=DEVICE)
    big_state = model.new_state(batch)
    big_state.ssm.copy_(rand(*big_state.ssm.shape, seed=12))
    small_state = big_state.rows(rows)
    big, small = make_decode_step(model, batch, deterministic), make_decode_step(model, len(rows), deterministic)
    assert type(big) is type(small)
    for _ in range(2):
        many = big(tokens, big_state)[slot].clone()
        few = small(tokens[rows], small_state)[rows.index(slot)]
        assert torch.equal(many, few)


# -- the products' step and its element-wise kernels (kernels/decode_gemm.py, products.py) ---------


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("M,N,K,splits", [(1, 40, 24, 1), (5, 33, 100, 3), (70, 48, 64, 8)])
def test_gemm_matches_its_ref_in_every_chunk(dtype, M, N, K, splits):
    """products.py's product: its K chunks (as many as split_count says, each K_ALIGN-aligned)
    add up to the product; the first chunk alone is the product over its own K range."""
    from fastmamba.kernels import products as gm

    dt = getattr(torch, dtype)
    a, w = rand(M, K, seed=30).to(dt), rand(N, K, seed=31).to(dt)
    S = gm.split_count(K, splits)
    assert S == min(splits, -(-K // gm.K_ALIGN))
    out = torch.full((S * M, N), float("nan"), device=DEVICE)
    gm.invariant_gemm(a, w, out, splits)
    parts = out.view(S, M, N)
    assert rel_err(parts.sum(0), gm.invariant_gemm_ref(a, w)) < 1e-5
    first = -(-K // S // gm.K_ALIGN) * gm.K_ALIGN if S > 1 else K
    assert rel_err(parts[0], gm.invariant_gemm_ref(a[:, :first], w[:, :first])) < 1e-5


def test_make_decode_step_builds_what_the_plan_says(checkpoints):
    """make_decode_step builds the step plan.plan_for names, with its cuBLAS
    products; a plan passed in wins over the table."""
    from fastmamba.engine.plan import ALL, IN_PROJ, NONE, DecodePlan, plan_for
    from fastmamba.kernels.decode_gemm import GemmDecodeStep

    for dtype in ("bfloat16", "float32"):
        model = fastmamba.load(checkpoints["kernel3_state8"], device=DEVICE, dtype=dtype).model
        storage = model.weights.embedding.dtype
        for batch in (1, 4, 5, 9, 33, 64, 65, 257):
            for deterministic in (False, True):
                plan = plan_for(model.config, storage, batch, deterministic)
                step = make_decode_step(model, batch, deterministic)
                if plan.step == "one-row":
                    assert isinstance(step, ds.DecodeStep) and not deterministic
                else:
                    assert isinstance(step, GemmDecodeStep) and step.cublas_products == set(plan.cublas), (dtype, batch)
        step = make_decode_step(model, 2, plan=DecodePlan("products", IN_PROJ))
        assert isinstance(step, GemmDecodeStep) and step.cublas_products == {"in_proj"}
    assert plan_for(model.config, torch.bfloat16, 300).cublas == ALL
    assert plan_for(model.config, torch.bfloat16, 300, deterministic=True).cublas == NONE


@pytest.mark.parametrize(
    "name,dtype,batch,products",
    [("untied_bias_rank", "bfloat16", 9, "cublas"), ("kernel3_state8", "float32", 20, "cublas"),
     ("untied_bias_rank", "bfloat16", 3, "triton"), ("kernel3_state8", "float32", 2, "triton"),
     ("odd_vocab_tied", "float16", 17, "triton"), ("untied_bias_rank", "bfloat16", 6, "triton, cuBLAS in_proj")],
)
def test_gemm_step_equals_the_reference_model(checkpoints, name, dtype, batch, products):
    """Whole steps of decode_gemm.py's step, its products through cuBLAS or through
    products.py (in K chunks), or all but in_proj through products.py."""
    from fastmamba.kernels.decode_gemm import GemmDecodeStep

    model = fastmamba.load(checkpoints[name], device=DEVICE, dtype=dtype).model
    from fastmamba.engine.plan import ALL, IN_PROJ, NONE, DecodePlan

    cublas = dict(cublas=ALL, triton=NONE).get(products, IN_PROJ)
    step = GemmDecodeStep(model, batch, DecodePlan("products", cublas))
    if products != "cublas":  # these models' x_proj and out_proj are long enough for two chunks or more
        assert step.chunks["x_proj"] >= 2 and step.chunks["out_proj"] >= 2
    state = model.new_state(batch)
    if dtype == "float32":
        state.ssm.copy_(rand(*state.ssm.shape, seed=11))
        ref_state = fastmamba.MambaState(state.conv.clone(), state.ssm.clone())
        for _ in range(3):
            tokens = torch.randint(0, model.config.vocab_size, (batch,), device=DEVICE)
            assert rel_err(step(tokens, state), model.step(tokens, ref_state)) < TOL[torch.float32]
        assert rel_err(state.ssm, ref_state.ssm) < TOL[torch.float32]
    else:  # each product's operand rounded once: transformers' own 16-bit error is the bar
        ids = torch.randint(0, model.config.vocab_size, (batch, 6), generator=torch.Generator().manual_seed(3))
        logits = torch.stack([step(ids[:, t].to(DEVICE), state).to('cpu', copy=True) for t in range(ids.shape[1])], 1)
        assert_within_transformers_16bit_error(logits, checkpoints[name], ids, dtype)


@pytest.mark.parametrize(  # the one-row step; the products step; all Triton
    "dtype,batch,deterministic", [("float32", 2, False), ("bfloat16", 2, False), ("bfloat16", 9, False), ("float32", 3, True)]
)
def test_decode_steps_keep_a_bfloat16_state(checkpoints, dtype, batch, deterministic):
    """state_dtype bf16: the decode kernels read the state, update it in float32 and store
    it rounded once, as the reference does (the products step also rounds its operands)."""
    path = checkpoints["untied_bias_rank"]
    model = fastmamba.load(path, device=DEVICE, dtype=dtype, state_dtype="bfloat16").model
    ref = fastmamba.load(path, dtype=dtype, state_dtype="bfloat16").model
    step = make_decode_step(model, batch, deterministic)
    state, ref_state = model.new_state(batch), ref.new_state(batch)
    ids = torch.randint(0, model.config.vocab_size, (batch, 5), generator=torch.Generator().manual_seed(batch))
    tol = 1e-3 if dtype == "float32" or step.plan.step == "one-row" else 2e-2
    for t in range(ids.shape[1]):
        assert rel_err(step(ids[:, t].to(DEVICE), state).cpu(), ref.step(ids[:, t], ref_state)) < tol, t
    assert state.ssm.dtype == state.conv.dtype == torch.bfloat16
    assert rel_err(state.ssm.float().cpu(), ref_state.ssm.float()) < max(tol, 1e-2)
    assert rel_err(state.conv.float().cpu(), ref_state.conv.float()) < max(tol, 1e-2)


@pytest.mark.parametrize(
    "name,dtype,batch,chunks,halves",
    [("untied_bias_rank", "bfloat16", 3, 1, True), ("untied_bias_rank", "bfloat16", 3, 1, False),
     ("kernel3_state8", "float32", 2, 1, False), ("untied_bias_rank", "bfloat16", 2, 3, True),
     ("untied_bias_rank", "float16", 2, 3, False), ("kernel3_state8", "float32", 3, 2, False)],
)
def test_gemm_step_kernels(checkpoints, name, dtype, batch, chunks, halves):
    """Each operand rounded once to the storage dtype, or (halves) written as two 16-bit
    halves (split16.py) whose results are read as the sum of their parts, two for each of
    `chunks` K chunks (products.py's products); float32: one operand, results in `chunks` parts."""
    from fastmamba.kernels import decode_gemm as dg
    from fastmamba.kernels import rmsnorm as rn

    model = fastmamba.load(checkpoints[name], device=DEVICE, dtype=dtype).model
    c, lw = model.config, model.weights.layers[0]
    sdt = model.weights.embedding.dtype
    split = halves
    E, N, R, B = c.d_inner, c.d_state, c.dt_rank, batch
    P = 2 * B if split else B
    H = 2 if split else 1

    def in_parts(v, n=H * chunks):  # a float32 result as the products leave it: n blocks of B rows that sum to v
        rest = [rand(*v.shape, seed=99 + i) * 0.1 for i in range(n - 1)]
        return torch.cat([v - sum(rest, torch.zeros_like(v))] + rest)

    # two 16-bit halves keep ~16 bits; one rounding 8 (bf16) or 11 (fp16)
    near = 1e-4 if split else {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}[sdt]

    def joined(v16):  # the operand a product sees, back in float32
        return v16[:B].float() + v16[B:].float() if split else v16.float()

    # residual + rmsnorm, with and without the add; o in halves or (as out_proj leaves it
    # when its operand is not split) whole
    h, o = rand(B, c.d_model, seed=20), rand(B, c.d_model, seed=21)
    bias = rand(c.d_model, seed=22)
    for add, o_parts in ((False, H * chunks), (True, H * chunks), (True, chunks)):
        hk, u = h.clone(), torch.empty(P, c.d_model, device=DEVICE, dtype=sdt)
        o_in = in_parts(o, o_parts) if add else None
        rn.residual_rmsnorm(hk, o_in, bias if add else None, lw.norm_w, c.norm_eps, u, o_parts=o_parts, u_halves=split)
        h_ref, u_ref = rn.residual_rmsnorm_ref(h, o if add else None, bias, lw.norm_w, c.norm_eps)
        assert rel_err(hk, h_ref) < 1e-6
        assert rel_err(joined(u), u_ref) < near
    # conv step
    xz = rand(B, 2 * E, seed=23)
    conv_state = rand(B, E, c.d_conv, seed=24)
    ref_state = conv_state.clone()
    xc, xc16 = torch.empty(B, E, device=DEVICE), torch.empty(P, E, device=DEVICE, dtype=sdt)
    for _ in range(2):
        dg.conv_step(in_parts(xz), conv_state, lw.conv_w, lw.conv_b, xc, xc16, xc16_halves=split, xz_parts=H * chunks,
                     block=PRODUCTS_BLOCKS.conv_step)
        ref = dg.conv_step_ref(xz[:, :E], ref_state, lw.conv_w, lw.conv_b)
        assert rel_err(xc, ref) < 1e-5
        assert rel_err(joined(xc16), xc) < near
        assert rel_err(conv_state, ref_state) < 1e-6
    # x_proj's result -> dbc and dt_proj's operand
    dbc_ref = rand(B, R + 2 * N, seed=25)
    dbc, dtr16 = torch.empty(B, R + 2 * N, device=DEVICE), torch.empty(P, R, device=DEVICE, dtype=sdt)
    dg.dbc_rows(in_parts(dbc_ref), dbc, dtr16, dtr_halves=split, raw_parts=H * chunks)
    assert rel_err(dbc, dbc_ref) < 1e-6
    assert rel_err(joined(dtr16), dbc_ref[:, :R]) < near
    # ssm update
    dt = rand(B, E, seed=26)
    ssm_state = rand(B, E, N, seed=27)
    ref_state = ssm_state.clone()
    ref = dg.ssm_update_ref(dt, dbc_ref[:, R : R + N], dbc_ref[:, R + N :], xc, xz[:, E:], ref_state, lw.dt_bias, lw.A, lw.D)
    for y_halves in (True, False) if split else (False,):  # y in halves, or rounded once (out_proj's operand)
        s = ssm_state.clone()
        y = torch.zeros(P, E, device=DEVICE, dtype=sdt)
        dg.ssm_update(in_parts(dt), dbc, xc, in_parts(xz), s, lw.dt_bias, lw.A, lw.D, R, y,
                      y_halves=y_halves, dt_parts=H * chunks, xz_parts=H * chunks, block=PRODUCTS_BLOCKS.ssm_update)
        assert rel_err(s, ref_state) < 1e-5
        if y_halves:
            assert rel_err(joined(y), ref) < near
        else:  # one rounding to the storage dtype: within its precision, and nothing in rows B..
            assert rel_err(y[:B].float(), ref) < (1e-6 if sdt == torch.float32 else 1e-2) and not y[B:].any()


SAMPLER_PARAMS = [  # every filter alone and together, greedy rows among them
    dict(),
    dict(temperature=0.8),
    dict(temperature=1.3, top_p=0.9),
    dict(temperature=0.7, top_k=40, repetition_penalty=1.1),
    dict(temperature=1.0, min_p=0.05),
    dict(repetition_penalty=1.3),
    dict(temperature=2.0, top_k=5, top_p=0.5, min_p=0.01),
    dict(temperature=20.0, top_k=2),  # hot rows: the filters' edges are drawn often
    dict(temperature=20.0, top_p=0.002),
    dict(temperature=20.0, min_p=0.95),
]


@pytest.mark.parametrize(
    "name, rounds", [("sample_filtered", 3), ("sample_filtered", 1), ("sample_filtered_apart", 3), ("sample_temperature", 3)]
)
def test_triton_samplers_match_sample(name, rounds):
    """kernels/sampler.py draws the tokens sampling.sample draws, step after step, and
    leaves the same steps and seen marks; a forced tie at the top goes to the lower index.
    The filters' search gathers at most 64 tokens here, so that it narrows its band a few
    times first, and with one pass its last step (one program narrowing alone) runs too."""
    from dataclasses import replace

    from fastmamba.core.sampling import SlotParams, sample
    from fastmamba.core.sampling_params import SamplingParams
    from fastmamba.kernels import sampler

    tiles = replace(SAMPLER_TILES, cap=64, rounds=rounds)
    params = [SamplingParams(**kw) for kw in SAMPLER_PARAMS]
    if name == "sample_temperature":
        params = [p for p in params if p.top_k == 0 and p.top_p == 1 and p.min_p == 0]
    if name == "sample_filtered_apart":
        params = [p for p in params if p.top_k == 0 or p.top_p == 1]
    B, V = len(params), 700

    def slots():
        s = SlotParams.empty(B, V, DEVICE)
        s.set_slots([(p, 100 + i, [1, 2, 3, 50 * i]) for i, p in enumerate(params)])
        return s

    ours, ref = slots(), slots()
    picked = []
    for t in range(12):
        logits = rand(B, V, seed=20 + t) * 3
        if t == 0:
            logits[:, 7] = logits[:, 9] = logits.max() + 1  # a tie for the top
        if t == 1:
            logits[-3:] = 0.5  # all tokens tied: the order is the tokens' own
        expected = sample(logits.clone(), ref)
        got = getattr(sampler, name)(logits.clone(), ours, tiles)
        assert torch.equal(got, expected), t
        if t == 0:
            assert (got[[i for i, p in enumerate(params) if p.temperature == 0]] == 7).all()
        picked.append(got)
    assert torch.equal(ours.step, ref.step) and torch.equal(ours.seen, ref.seen)
    assert len(set(torch.stack(picked).flatten().tolist())) > 20  # not stuck on a few tokens


@pytest.mark.parametrize("B", [63, 130])
def test_triton_sampler_rows_past_one_finish_tile(B):
    """The last launch (_finish_kernel) goes over the rows 64 at a time, whatever the batch:
    rows past the first 64 draw what sampling.sample draws, greedy and hot rows mixed, in an
    odd batch (its rows padded to an even length, so the sampled row stays aligned) as in an
    even one."""
    from fastmamba.core.sampling import SlotParams, sample
    from fastmamba.core.sampling_params import SamplingParams
    from fastmamba.kernels import sampler

    V = 50
    params = [SamplingParams(temperature=0.8 if i % 3 else 0.0, seed=i) for i in range(B)]

    def slots():
        s = SlotParams.empty(B, V, DEVICE)
        s.set_slots([(p, i, [1, 2]) for i, p in enumerate(params)])
        return s

    ours, ref = slots(), slots()
    for t in range(2):
        logits = rand(B, V, seed=40 + t) * 3
        expected = sample(logits.clone(), ref)
        assert torch.equal(sampler.sample_temperature(logits.clone(), ours, SAMPLER_TILES), expected), t
    assert torch.equal(ours.step, ref.step) and torch.equal(ours.seen, ref.seen)
