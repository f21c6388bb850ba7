"""FP8 weights (load(dtype="fp8")) on the reference engine: the quantization's error bounds,
the model's logits against float32, and the GPU refused before it is touched."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
import torch
from conftest import relative_error

import fastmamba
from fastmamba.core import fp8
from fastmamba.core.fp8 import Fp8Weight, quantize
from fastmamba.core.sampling_params import SamplingParams
from fastmamba.engine.engine_core import EngineCore
from fastmamba.engine.protocol import Finished, Request, Token

transformers = pytest.importorskip("transformers")

# e4m3 keeps 4 significant bits: a value in [2^e, 2^(e+1)) is rounded to a multiple of
# 2^(e-3), off by at most half of it, 2^(e-4) <= |q| / 16; below 2^-6 (subnormals) the step
# is 2^-9, off by at most 2^-10. In the weight's units, times the row's scale.
# The float32 division by the scale and the dequantizing product each round once more
# (2^-24 relative): SLACK covers them.
SLACK = 1 + 2**-16
# e4m3's relative step is 16 times bfloat16's (2^-3 against 2^-7): FP8 logits may be off by
# at most 20x what bfloat16 storage gives on the same inputs (measured: 4x to 15x).
FP8_OVER_BF16 = 20.0


def rows_of_many_magnitudes(out: int = 64, k: int = 96) -> torch.Tensor:
    """Rows whose largest values span 1e-6 .. 1e4, each row's values spanning 1e-4 of its
    largest to the largest (subnormals after scaling included), with a zero row."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(out, k, generator=g) * torch.logspace(-4, 0, k)[torch.randperm(k, generator=g)]
    w = w * torch.logspace(-6, 4, out)[:, None]
    w[5] = 0
    return w


def test_quantize_dequantize_error_is_within_the_e4m3_step():
    w = rows_of_many_magnitudes()
    q = quantize(w)
    assert q.data.dtype == torch.float8_e4m3fn and q.scale.dtype == torch.float32 and q.shape == w.shape
    amax = w.abs().amax(1)
    assert torch.equal(q.scale, torch.where(amax > 0, amax / 448, torch.ones_like(amax)))
    deq = q.dequantize()
    err = (w - deq).abs()
    # each element: half a step of its binade, or of the subnormals
    assert (err <= (w.abs() / 16 + q.scale[:, None] * 2**-10) * SLACK).all()
    # each row: a row's largest |q| is 448, in [256, 448] the step is 32, so the error is
    # at most 16 / 448 of the row's largest magnitude (amax / 28)
    assert (err.amax(1) <= amax / 28 * SLACK).all()
    assert (w.abs().amax(1) == 0).sum() == 1 and q.dequantize()[5].eq(0).all() and q.scale[5] == 1
    # round to nearest: no e4m3 value lies nearer to w / scale than the one stored
    table = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    table = table[torch.isfinite(table)]
    exact = w / q.scale[:, None]
    nearest = (exact[..., None] - table).abs().amin(-1)
    assert torch.equal((exact - q.data.float()).abs(), nearest)


def test_quantize_saturates_at_448_and_never_makes_nan():
    w = torch.tensor([[1000.0, -1e6, 448.0, 449.0, 0.5], [3.0, -3.0, 0.0, 1e-9, 2.0]])
    q = quantize(w, scale=torch.ones(2))
    assert q.data.float()[0].tolist() == [448.0, -448.0, 448.0, 448.0, 0.5]
    assert torch.isfinite(q.data.float()).all()
    assert q.data.float()[1].tolist() == [3.0, -3.0, 0.0, 0.0, 2.0]


def test_the_product_applies_the_scales_to_the_sums():
    w = rows_of_many_magnitudes(33, 40) * 1e-3
    x = torch.randn(3, 5, 40)
    b = torch.randn(33)
    q = quantize(w)
    ref = torch.nn.functional.linear(x.double(), q.dequantize().double(), b.double())
    assert relative_error(fp8.linear(x, q, b), ref) < 1e-6
    # block scales (8 x 16 blocks, the last ones cut short by the edge)
    scale = torch.rand(5, 3) + 0.5
    blocked = Fp8Weight(q.data, scale, (8, 16))
    dense = q.data.double() * scale.repeat_interleave(8, 0)[:33].repeat_interleave(16, 1)[:, :40].double()
    assert torch.equal(blocked.dequantize(), dense.float())
    assert relative_error(fp8.linear(x, blocked), torch.nn.functional.linear(x.double(), dense)) < 1e-6
    assert q.nbytes == 33 * 40 + 33 * 4 and fp8.nbytes(q) == q.nbytes


# -- the model --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bundled():
    return {dt: fastmamba.load(dtype=dt) for dt in ("float32", "bfloat16", "fp8")}


def test_the_bundled_model_in_fp8(bundled):
    f32, bf16, lm = bundled["float32"], bundled["bfloat16"], bundled["fp8"]
    assert lm.dtype == torch.float8_e4m3fn and lm.engine == "reference"
    w = lm.model.weights
    assert w.embedding.dtype == torch.float32 and w.lm_head is w.embedding  # (tied)
    for lw in w.layers:
        for name in ("in_proj_w", "x_proj_w", "dt_proj_w", "out_proj_w"):
            assert isinstance(getattr(lw, name), Fp8Weight), name
        assert lw.A.dtype == lw.D.dtype == lw.conv_w.dtype == lw.norm_w.dtype == torch.float32
    ids = torch.tensor([f32.encode("To be, or not to be, that is the question: whether 'tis nobler in the mind")])
    ref = f32.forward(ids)
    err = relative_error(lm.forward(ids), ref)
    assert err <= FP8_OVER_BF16 * relative_error(bf16.forward(ids), ref), err
    a = f32.generate("To be, or not to be", max_tokens=32, stop_token_ids=[]).token_ids
    b = lm.generate("To be, or not to be", max_tokens=32, stop_token_ids=[]).token_ids
    assert next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), 32) >= 8, (a, b)


def test_fp8_generate_batch_equals_each_alone(bundled):
    lm = bundled["fp8"]
    prompts = ["ROMEO.\n", "Now is the winter of our discontent", "To be"]
    params = [SamplingParams(max_tokens=8, temperature=0.8 * (k % 2), seed=k, stop_token_ids=[]) for k in range(3)]
    together = lm.generate_batch(prompts, params)
    assert [g.token_ids for g in together] == [lm.generate(p, q).token_ids for p, q in zip(prompts, params)]


def test_fp8_models_are_not_a_backbone_nor_on_the_gpu_ops(bundled):
    lm = bundled["fp8"]
    with pytest.raises(ValueError, match="fp8"):
        lm.backbone
    with pytest.raises(ValueError, match="fp8"):
        fastmamba.Backbone(fastmamba.BackboneConfig(input_dim=4, d_model=8, n_layer=1), dtype="fp8")
    from fastmamba.core.model import Mamba
    from fastmamba.core.ops import REFERENCE_OPS

    with pytest.raises(ValueError, match="fp8 kernels are not built yet"):
        Mamba(lm.config, lm.model.weights, dataclasses.replace(REFERENCE_OPS))


def tiny_hybrid(name: str, folder):
    from test_hybrids import CASES

    config, model_class = CASES[name]()
    torch.manual_seed(0)
    model = model_class(config).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(folder)
    return model


@pytest.mark.parametrize("name", ["nemotron_h", "falcon_h1"])
def test_a_hybrid_in_fp8(tmp_path, name):
    """Nemotron-H (Mamba-2, attention, a squared-ReLU MLP); Falcon-H1 (attention beside Mamba-2,
    no SSM norm, gate and up as one FP8 matrix, its multipliers folded in before quantizing):
    logits within FP8_OVER_BF16 of bfloat16's error; the prefix cache and 8-token chunks
    change no token."""
    tiny_hybrid(name, tmp_path)
    x = torch.randint(0, 160, (2, 33), generator=torch.Generator().manual_seed(5))
    ref = fastmamba.load(tmp_path).forward(x)
    lm = fastmamba.load(tmp_path, dtype="fp8")
    err = relative_error(lm.forward(x), ref)
    assert err <= FP8_OVER_BF16 * relative_error(fastmamba.load(tmp_path, dtype="bfloat16").forward(x), ref), err
    core = EngineCore(lm.model, lm.prefill, max_batch=2, prefill_tokens=8, prefix_cache_bytes=16 << 20)
    core.cache.interval = 16
    base = x[0].tolist()
    prompts = [base, base + [5, 6], base[:20], base]
    got = {}
    for rid, p in enumerate(prompts):
        core.add(Request(rid, p, SamplingParams(max_tokens=5, stop_token_ids=[])))
        while core.has_work:
            for out in core.step():
                assert isinstance(out, (Token, Finished)), out
                if isinstance(out, Token):
                    got.setdefault(out.rid, []).append(out.token)
    assert core.cache_hits >= 2
    for rid, p in enumerate(prompts):
        assert got[rid] == lm.generate(p, max_tokens=5, stop_token_ids=[]).token_ids, rid


# -- the GPU, the command line -----------------------------------------------------------------


def test_fp8_on_the_gpu_is_refused_before_the_gpu_is_touched(monkeypatch):
    import fastmamba.engine.loader as loader

    def touched(*a, **k):
        raise AssertionError("the GPU or the checkpoint was touched")

    monkeypatch.setattr(torch.cuda, "is_available", touched)
    monkeypatch.setattr(torch.cuda, "init", touched)
    monkeypatch.setattr(loader, "checkpoint_folder", touched)
    for device in ("cuda", "cuda:1"):
        with pytest.raises(ValueError, match="the GPU's fp8 kernels are not built yet"):
            fastmamba.load(device=device, dtype="fp8")


def test_the_command_line_generates_with_fp8(bundled):
    r = subprocess.run([sys.executable, "-m", "fastmamba.cli", "generate", "--dtype", "fp8", "--max-tokens", "12",
                        "To be, or not to be"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout == bundled["fp8"].generate("To be, or not to be", max_tokens=12).text + "\n"
