"""Prefill through the Triton conv and scan kernels (interpreter on the CPU, compiled on a GPU)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from conftest import relative_error as rel_err

import fastmamba
from fastmamba.core.mamba1 import in_proj_dtype
from fastmamba.core.model import Mamba
from fastmamba.core.ops import triton_ops
from fastmamba.engine.plan import CONV_TILES, KERNEL_TILES, SCAN_TILES, STEP_SIZE_TILES
from fastmamba.kernels import selective_scan as ss
from fastmamba.kernels.causal_conv1d import causal_conv1d, causal_conv1d_ref
from fastmamba.kernels.products import linear_storage
from fastmamba.kernels.selective_scan import (
    ScanLaunch,
    selective_scan,
    selective_scan_ref,
    step_and_scan,
    step_and_scan_ref,
)
from fastmamba.kernels.step_size import step_size, step_size_ref

pytest.importorskip("triton")
GPU = torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"
TOL = {"float32": 1e-3, "bfloat16": 2e-2, "float16": 2e-2}



def gen(seed=0):
    return torch.Generator(device=DEVICE).manual_seed(seed)


def assert_rounded(v16, v):
    """v16 is float32 v in bfloat16, rounded as a cast rounds (to nearest even)."""
    assert v16.dtype == torch.bfloat16 and torch.equal(v16, v.to(torch.bfloat16))


@pytest.mark.parametrize(
    "B,E,T,K,start",
    [(2, 40, 37, 4, None), (3, 16, 5, 3, [0, 2, 4]), (1, 8, 1, 4, None), (2, 70, 100, 4, [0, 50]), (1, 24, 66, 2, [3]),
     (2, 40, 300, 4, [0, 170]),  # several scan chunks, padding ending in the second
     (2, 128, 80, 4, [0, 70]),  # full channel blocks (the scan's loads unmasked)
     (2, 16, 20, 5, [0, 3])],  # a conv wider than the kernel's window (the PyTorch fallback)
)
def test_conv_and_scan_kernels_match_their_twins(B, E, T, K, start):
    g = gen(1)
    xz = torch.randn(B, T, 2 * E, device=DEVICE, generator=g)  # strided views, as in the model
    x, z = xz[..., :E].transpose(1, 2), xz[..., E:].transpose(1, 2)
    w, b = torch.randn(E, K, device=DEVICE, generator=g), torch.randn(E, device=DEVICE, generator=g)
    conv_state0 = torch.randn(B, E, K, device=DEVICE, generator=g)
    conv_state, conv_ref_state = conv_state0.clone(), conv_state0.clone()
    s = None if start is None else torch.tensor(start, dtype=torch.int32, device=DEVICE)
    xc = causal_conv1d(x, w, b, conv_state, s, tiles=CONV_TILES)
    xc_ref = causal_conv1d_ref(x, w, b, conv_ref_state, s)
    assert rel_err(xc, xc_ref) < 1e-5 and rel_err(conv_state, conv_ref_state) < 1e-6
    xc16 = causal_conv1d(x, w, b, conv_state0.clone(), s, torch.bfloat16, tiles=CONV_TILES)  # as a bf16 model's
    assert_rounded(xc16, xc)

    N, R = 16, 3
    dbc = torch.randn(B, T, R + 2 * N, device=DEVICE, generator=g)
    delta = torch.rand(B, T, E, device=DEVICE, generator=g).transpose(1, 2)  # (B, E, T), as step_size's
    A = -torch.rand(E, N, device=DEVICE, generator=g) * 4
    D = torch.randn(E, device=DEVICE, generator=g)
    Bm, Cm = dbc[..., R : R + N].transpose(1, 2), dbc[..., R + N :].transpose(1, 2)
    ssm_state0 = torch.randn(B, E, N, device=DEVICE, generator=g)
    ssm_ref_state = ssm_state0.clone()
    y_ref = selective_scan_ref(xc_ref, delta, A, Bm, Cm, D, z, ssm_ref_state, s)
    # the one-pass scan; the chunked one as chunked_launch runs it here, with 4 channels a
    # thread in 64-step chunks, and as one chunk of one channel a thread
    scans = [dict(chunked=False), dict(chunked=True), dict(chunked=True, launch=ScanLaunch(64, 128, 4, 1, 4, 2)),
             dict(chunked=True, launch=ScanLaunch(T, 64, 1, 2, 3, 4))]
    for kw in scans:
        ssm_state = ssm_state0.clone()
        y = selective_scan(xc_ref, delta, A, Bm, Cm, D, z, ssm_state, s, tiles=SCAN_TILES, **kw)
        assert rel_err(y, y_ref) < 1e-5 and rel_err(ssm_state, ssm_ref_state) < 1e-5, kw
        # y straight in out_proj's dtype
        assert_rounded(selective_scan(xc_ref, delta, A, Bm, Cm, D, z, ssm_state0.clone(), s, out_dtype=torch.bfloat16, tiles=SCAN_TILES, **kw), y)
    # x as a bf16 model's conv writes it (a 16-bit input, read into float32)
    y16_ref = selective_scan_ref(xc16.float(), delta, A, Bm, Cm, D, z, ssm_state0.clone(), s)
    for kw in scans:  # (one channel a thread loads pairs of channels: see selective_scan._channels_at)
        y16 = selective_scan(xc16, delta, A, Bm, Cm, D, z, ssm_state0.clone(), s, tiles=SCAN_TILES, **kw)
        assert rel_err(y16, y16_ref) < 1e-5, kw
    # and 16-bit x whose channels are not contiguous: no pairs, one 16-bit load a channel
    y16 = selective_scan(xc16.contiguous(), delta, A, Bm, Cm, D, z, ssm_state0.clone(), s, tiles=SCAN_TILES, **scans[3])
    assert rel_err(y16, y16_ref) < 1e-5
    # and a float16 model's (the pairs' halves read back as float16)
    xch = causal_conv1d(x, w, b, conv_state0.clone(), s, torch.float16, tiles=CONV_TILES)
    yh = selective_scan(xch, delta, A, Bm, Cm, D, z, ssm_state0.clone(), s, tiles=SCAN_TILES, **scans[3])
    assert rel_err(yh, selective_scan_ref(xch.float(), delta, A, Bm, Cm, D, z, ssm_state0.clone(), s)) < 1e-5
    # x and z as a bf16 model's in_proj writes them (model.in_proj_dtype): the conv reads a
    # 16-bit x, the scan a 16-bit z (pairs of channels where one channel a thread)
    xz16 = xz.to(torch.bfloat16)
    x16, z16 = xz16[..., :E].transpose(1, 2), xz16[..., E:].transpose(1, 2)
    cs, cs_ref = conv_state0.clone(), conv_state0.clone()
    xc_from16 = causal_conv1d(x16, w, b, cs, s, tiles=CONV_TILES)
    assert rel_err(xc_from16, causal_conv1d_ref(x16, w, b, cs_ref, s)) < 1e-5 and rel_err(cs, cs_ref) < 1e-6
    assert rel_err(xc_from16, xc_ref) > 0  # (x16 is not x)
    yz_ref = selective_scan_ref(xc_ref, delta, A, Bm, Cm, D, z16, ssm_state0.clone(), s)
    for kw in scans:
        yz = selective_scan(xc_ref, delta, A, Bm, Cm, D, z16, ssm_state0.clone(), s, tiles=SCAN_TILES, **kw)
        assert rel_err(yz, yz_ref) < 1e-5, kw

    # dt_proj's output before its bias and softplus, which the walks then take (step_and_scan
    # at large batches): against the step sizes made first
    dt = torch.randn(B, T, E, device=DEVICE, generator=g).transpose(1, 2) * 3
    dt_bias = torch.randn(E, device=DEVICE, generator=g) - 2
    ssm_ref_state = ssm_state0.clone()
    y_ref = selective_scan_ref(xc_ref, F.softplus(dt + dt_bias[:, None]), A, Bm, Cm, D, z, ssm_ref_state, s)
    for kw in scans:  # (the kernels' softplus is within 5e-6 of torch's: test_step_size_softplus_elementwise)
        ssm_state = ssm_state0.clone()
        y = selective_scan(xc_ref, dt, A, Bm, Cm, D, z, ssm_state, s, dt_bias=dt_bias, tiles=SCAN_TILES, **kw)
        assert rel_err(y, y_ref) < 2e-5 and rel_err(ssm_state, ssm_ref_state) < 2e-5, kw


@pytest.mark.parametrize("B,E,T,K,start", [(3, 40, 70, 4, None), (2, 16, 33, 3, [0, 5]), (2, 128, 40, 4, None)])
def test_conv_and_scan_kernels_take_resets(B, E, T, K, start):
    """resets (B, T): the conv's window and the scan's state start afresh at a reset step,
    in every scan (one pass; chunked with 4 or 1 channels a thread, a reset in the first
    step, inside chunks and in the last step), as their twins do."""
    g = gen(4)
    x, z = torch.randn(B, E, T, device=DEVICE, generator=g), torch.randn(B, E, T, device=DEVICE, generator=g)
    w, b = torch.randn(E, K, device=DEVICE, generator=g), torch.randn(E, device=DEVICE, generator=g)
    resets = torch.rand(B, T, device=DEVICE, generator=g) < 0.08
    resets[0, 0] = resets[1, T - 1] = resets[1, 17] = True
    s = None if start is None else torch.tensor(start, dtype=torch.int32, device=DEVICE)
    conv0 = torch.randn(B, E, K, device=DEVICE, generator=g)
    conv, conv_ref = conv0.clone(), conv0.clone()
    xc = causal_conv1d(x, w, b, conv, s, resets=resets, tiles=CONV_TILES)
    xc_ref = causal_conv1d_ref(x, w, b, conv_ref, s, resets=resets)
    assert rel_err(xc, xc_ref) < 1e-5 and rel_err(conv, conv_ref) < 1e-6
    assert rel_err(causal_conv1d_ref(x, w, b, conv0.clone(), s), xc_ref) > 1e-2  # the resets mattered
    N = 16
    delta = torch.rand(B, E, T, device=DEVICE, generator=g)
    A, D = -torch.rand(E, N, device=DEVICE, generator=g) * 4, torch.randn(E, device=DEVICE, generator=g)
    Bm, Cm = torch.randn(B, N, T, device=DEVICE, generator=g), torch.randn(B, N, T, device=DEVICE, generator=g)
    ssm0 = torch.randn(B, E, N, device=DEVICE, generator=g)
    ssm_ref = ssm0.clone()
    y_ref = selective_scan_ref(xc_ref, delta, A, Bm, Cm, D, z, ssm_ref, s, resets=resets)
    for kw in [dict(chunked=False), dict(chunked=True, launch=ScanLaunch(16, 128, 4, 1, 4, 2)),
               dict(chunked=True, launch=ScanLaunch(32, 64, 1, 2, 3, 4))]:
        ssm = ssm0.clone()
        y = selective_scan(xc_ref, delta, A, Bm, Cm, D, z, ssm, s, resets=resets, tiles=SCAN_TILES, **kw)
        assert rel_err(y, y_ref) < 1e-5 and rel_err(ssm, ssm_ref) < 1e-5, kw


@pytest.mark.parametrize("wdt", [torch.float32, torch.bfloat16])
def test_step_and_scan_as_one_chunk(wdt):
    """The scan as one chunk (forced here at a small shape) runs dt_proj alone and takes the
    softplus in its walk: against the reference (float32 weights), and against the step
    sizes made first by step_size.py's kernel (16-bit weights, whose products both paths
    take with dt_r rounded to the weights' dtype)."""
    B, E, T, N, R = 2, 40, 100, 16, 3
    g = gen(3)
    xz = torch.randn(B, T, 2 * E, device=DEVICE, generator=g)
    x, z = xz[..., :E].transpose(1, 2), xz[..., E:].transpose(1, 2)
    dbc = torch.randn(B, T, R + 2 * N, device=DEVICE, generator=g)
    dt_r, Bm, Cm = dbc[..., :R], dbc[..., R : R + N].transpose(1, 2), dbc[..., R + N :].transpose(1, 2)
    w = (torch.randn(E, R, device=DEVICE, generator=g)).to(wdt)
    bias = torch.randn(E, device=DEVICE, generator=g) - 1
    A = -torch.rand(E, N, device=DEVICE, generator=g) * 4
    D = torch.randn(E, device=DEVICE, generator=g)
    state0 = torch.randn(B, E, N, device=DEVICE, generator=g)
    start = torch.tensor([0, 30], dtype=torch.int32, device=DEVICE)
    ref_state = state0.clone()
    if wdt == torch.float32:
        ref = step_and_scan_ref(x, dt_r, w, bias, A, Bm, Cm, D, z, ref_state, start)
    else:
        ref = step_and_scan(x, dt_r, w, bias, A, Bm, Cm, D, z, ref_state, start, tiles=SCAN_TILES)  # (not one chunk at this shape)
    one_chunk = replace(SCAN_TILES, chunked_work=1, one_chunk_lanes=1, softplus_from_rank=1)
    assert ss.chunked_launch(B, E, T, one_chunk).L >= T
    state = state0.clone()
    y = step_and_scan(x, dt_r, w, bias, A, Bm, Cm, D, z, state, start, tiles=one_chunk)
    # (on the CPU, 16-bit weights: the CPU's bf16 product rounds its output to bf16)
    tol = 2e-5 if GPU or wdt == torch.float32 else 1e-2
    assert rel_err(y, ref) < tol and rel_err(state, ref_state) < tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("B,T,R,E", [(1, 5, 3, 40), (2, 150, 48, 200)])  # tiles partly filled; R over one K block
def test_step_size_kernel_matches_its_twin(dtype, B, T, R, E):
    g = gen(2)
    dbc = torch.randn(B, T, R + 32, device=DEVICE, generator=g)  # dt_r is a slice of x_proj's output
    w = (torch.randn(E, R, device=DEVICE, generator=g) / R**0.5).to(dtype)
    bias = torch.randn(E, device=DEVICE, generator=g) * 4  # some softplus inputs above 20 after the product
    bias[:3] = 25.0
    dt_r = dbc[..., :R]
    ref = step_size_ref(dt_r.to(dtype), w, bias)  # the activations rounded to the weights' dtype, as the kernel takes them
    delta = step_size(dt_r, w, bias, tiles=STEP_SIZE_TILES)
    assert delta.shape == (B, T, E) and delta.dtype == torch.float32 and (delta > 0).all()
    assert rel_err(delta, ref) < 1e-5


def test_step_size_softplus_elementwise():
    """softplus of exactly known inputs (dt_r zero, so delta = softplus(bias)) across its
    branches: the series below u = exp(v) = 1/32, the hardware log2 above, v itself past 20.
    Each element within 1e-5 of float64's softplus, relative."""
    v = torch.linspace(-40.0, 30.0, 7001, device=DEVICE)
    delta = step_size(torch.zeros(1, 1, 1, device=DEVICE), torch.zeros(v.numel(), 1, device=DEVICE), v, tiles=STEP_SIZE_TILES)[0, 0]
    exact = torch.nn.functional.softplus(v.double().cpu())
    assert ((delta.double().cpu() - exact).abs() / exact).max() < 1e-5


def test_conv_silu_elementwise():
    """silu of exactly known inputs (zero inputs and weights, so the conv's output is
    silu(bias)) over [-60, 60]: each element within 1e-5 of float64's, relative."""
    v = torch.linspace(-60.0, 60.0, 6000, device=DEVICE)  # (an even count: 0 is not among them)
    E = v.numel()
    state = torch.zeros(1, E, 4, device=DEVICE)
    y = causal_conv1d(torch.zeros(1, E, 1, device=DEVICE), torch.zeros(E, 4, device=DEVICE), v, state, tiles=CONV_TILES)[0, :, 0]
    exact = torch.nn.functional.silu(v.double().cpu())
    assert ((y.double().cpu() - exact).abs() / exact.abs()).max() < 1e-5


def test_in_proj_writes_bf16_for_bf16_weights():
    """A bf16 model's in_proj writes x and z in bf16 (float32's range, nothing overflows);
    float16 and float32 models' in float32 (float16's range could: docs/architecture.md). The rounded
    output is the float32 one (plus bias) rounded once."""
    assert in_proj_dtype(torch.bfloat16) == torch.bfloat16
    assert in_proj_dtype(torch.float16) == torch.float32 and in_proj_dtype(torch.float32) == torch.float32
    g = gen(4)
    u = torch.randn(3, 5, 64, device=DEVICE, generator=g)
    w = torch.randn(48, 64, device=DEVICE, generator=g).to(torch.bfloat16)
    for bias in (None, torch.randn(48, device=DEVICE, generator=g)):
        y = linear_storage(u, w, bias)
        y16 = linear_storage(u, w, bias, torch.bfloat16)
        assert y.dtype == torch.float32 and y16.dtype == torch.bfloat16 and y16.shape == y.shape == (3, 5, 48)
        # (cuBLAS may sum in another order for a 16-bit output: within a bf16 step, not bitwise)
        assert ((y16.float() - y).abs() <= y.abs() * 2**-7).all()


def engines(path, dtype, state_dtype="float32"):
    """The same checkpoint as the reference model and as the Triton-prefill model."""
    ref = fastmamba.load(path, dtype=dtype, state_dtype=state_dtype).model
    w = fastmamba.load(path, device=DEVICE, dtype=dtype).model.weights
    return ref, Mamba(ref.config, w, triton_ops(KERNEL_TILES), state_dtype=ref.state_dtype)


LENGTHS = [1, 3, 4, 255, 256, 1000] if GPU else [1, 3, 4, 20]  # the interpreter is slow


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_prefill_then_decode_equals_step_by_step(dtype, checkpoints):
    ref, fast = engines(checkpoints["odd_vocab_tied"], dtype)  # d_conv 4
    V = ref.config.vocab_size
    for T in LENGTHS:
        ids = torch.randint(0, V, (2, T + 2), generator=torch.Generator().manual_seed(T))
        step_state = ref.new_state(2)
        steps = [ref.step(ids[:, t], step_state) for t in range(T + 2)]
        state = fast.new_state(2)
        last = fast.prefill(ids[:, :T].to(DEVICE), state, last_only=True)
        assert rel_err(last, steps[T - 1]) < TOL[dtype], T
        ref_state = ref.new_state(2)
        ref.prefill(ids[:, :T], ref_state)
        assert rel_err(state.ssm, ref_state.ssm) < TOL[dtype] and rel_err(state.conv, ref_state.conv) < TOL[dtype]
        for t in (T, T + 1):  # decoding continues where T single steps would have left it
            assert rel_err(fast.step(ids[:, t].to(DEVICE), state), steps[t]) < TOL[dtype], (T, t)


@pytest.mark.parametrize("dtype", ["bfloat16"] if not GPU else ["float32", "bfloat16"])  # (the interpreter is slow)
def test_a_bfloat16_state_through_the_prefill_kernels(dtype, checkpoints):
    """The conv and scan kernels read a bf16 state, update it in float32 and store it
    rounded once, as the reference does; decoding goes on from it."""
    ref, fast = engines(checkpoints["odd_vocab_tied"], dtype, "bfloat16")
    for T in LENGTHS:
        ids = torch.randint(0, ref.config.vocab_size, (2, T + 2), generator=torch.Generator().manual_seed(T))
        state, ref_state = fast.new_state(2), ref.new_state(2)
        last = fast.prefill(ids[:, :T].to(DEVICE), state, last_only=True)
        ref_last = ref.prefill(ids[:, :T], ref_state, last_only=True)
        assert state.ssm.dtype == state.conv.dtype == torch.bfloat16
        assert rel_err(last, ref_last) < TOL[dtype], T
        assert rel_err(state.ssm, ref_state.ssm) < TOL["bfloat16"] and rel_err(state.conv, ref_state.conv) < TOL["bfloat16"]
        for t in (T, T + 1):
            assert rel_err(fast.step(ids[:, t].to(DEVICE), state), ref.step(ids[:, t], ref_state)) < TOL[dtype], (T, t)


def test_chunked_prefill_equals_unchunked(checkpoints):
    _, fast = engines(checkpoints["kernel3_state8"], "float32")
    ids = torch.randint(0, fast.config.vocab_size, (2, 20), device=DEVICE)
    whole_state, chunked_state = fast.new_state(2), fast.new_state(2)
    whole = fast.prefill(ids, whole_state)
    fast.chunk_tokens = 12  # 6 steps a row
    chunked = fast.prefill(ids, chunked_state)
    assert rel_err(chunked, whole) < 1e-5
    assert rel_err(chunked_state.ssm, whole_state.ssm) < 1e-5
    last = fast.prefill(ids, fast.new_state(2), last_only=True)
    assert rel_err(last, whole[:, -1]) < 1e-5


def test_left_padded_rows_equal_their_prompts_alone(checkpoints):
    _, fast = engines(checkpoints["untied_bias_rank"], "float32")
    V = fast.config.vocab_size
    prompts = [torch.randint(0, V, (n,)).tolist() for n in (9, 2, 5)]
    padded = torch.tensor([[3] * (9 - len(p)) + p for p in prompts], device=DEVICE)
    start = torch.tensor([9 - len(p) for p in prompts], dtype=torch.int32, device=DEVICE)
    state = fast.new_state(3)
    state.ssm[:, 1:].fill_(5.0)  # whatever a padded row's slot held before, it starts afresh
    last = fast.prefill(padded, state, start, last_only=True)
    for i, p in enumerate(prompts):
        alone_state = fast.new_state(1)
        alone = fast.prefill(torch.tensor([p], device=DEVICE), alone_state, last_only=True)
        assert rel_err(last[i], alone[0]) < 1e-5
        assert rel_err(state.ssm[:, i], alone_state.ssm[:, 0]) < 1e-5
