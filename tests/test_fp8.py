"""FP8 weights (load(dtype="fp8")) on the reference engine: the quantization's error bounds,
the model's logits against float32, FP8 checkpoints written by compressed-tensors itself, the
schemes refused by name. (The GPU's FP8 kernels: tests/test_fp8_kernels.py.)"""

from __future__ import annotations

import dataclasses
import json
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
from fastmamba.engine.protocol import Request

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


def test_fp8_models_are_not_a_backbone_nor_on_ops_without_fp8(bundled):
    lm = bundled["fp8"]
    with pytest.raises(ValueError, match="fp8"):
        lm.backbone
    with pytest.raises(ValueError, match="fp8"):
        fastmamba.Backbone(fastmamba.BackboneConfig(input_dim=4, d_model=8, n_layer=1), dtype="fp8")
    from fastmamba.core.model import Mamba
    from fastmamba.core.ops import REFERENCE_OPS

    with pytest.raises(ValueError, match="fp8 weights run on the reference ops or the GPU's"):
        Mamba(lm.config, lm.model.weights, dataclasses.replace(REFERENCE_OPS, fp8=False))


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
    from test_hybrids import run_until_done

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
        run_until_done(core, got)
    assert core.cache_hits >= 2
    for rid, p in enumerate(prompts):
        assert got[rid] == lm.generate(p, max_tokens=5, stop_token_ids=[]).token_ids, rid


# -- FP8 checkpoints (compressed-tensors) -------------------------------------------------------


def compress(model, folder, strategy: str, block=None, static_inputs: bool = False, ignore=(), fmt=None):
    """`model` quantized and saved by compressed-tensors itself: float8 e4m3 weights of every
    Linear but `ignore`, symmetric, scales by `strategy` from each matrix's own range (the
    library's calculate_qparams, as its observers give them), then its ModelCompressor's
    compress_model, save_pretrained and update_config. Returns the decompressed weights the
    library gives back, by module name (what a load must reproduce), and the stored values and
    scales; `model` is left decompressed, as a float32 model of those weights."""
    ct = pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        QuantizationStatus,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.utils import calculate_qparams

    weights = dict(num_bits=8, type="float", strategy=strategy, symmetric=True, dynamic=False)
    if block:
        weights["block_structure"] = list(block)
    inputs = QuantizationArgs(num_bits=8, type="float", strategy="tensor", symmetric=True, dynamic=False) \
        if static_inputs else None
    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(**weights), input_activations=inputs)
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=list(ignore),
                                                        quantization_status=QuantizationStatus.INITIALIZED))
    for _, module in model.named_modules():
        if not hasattr(module, "weight_scale"):
            continue
        w = module.weight.data
        if strategy == "tensor":
            lo, hi = w.min().reshape(1), w.max().reshape(1)
        elif strategy == "channel":
            lo, hi = w.amin(1, keepdim=True), w.amax(1, keepdim=True)
        else:
            from compressed_tensors.quantization.utils import maybe_pad_tensor_for_block_quant

            r, c = block
            p = maybe_pad_tensor_for_block_quant(w, (r, c))
            b = p.reshape(p.shape[0] // r, r, p.shape[1] // c, c).transpose(1, 2)
            lo, hi = b.amin((-1, -2)), b.amax((-1, -2))
        scale, _ = calculate_qparams(lo, hi, module.quantization_scheme.weights)
        module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
        if static_inputs:
            module.input_scale.data.fill_(0.05)
    compressor = ModelCompressor.from_pretrained_model(model, fmt)
    compressor.compress_model(model)
    model.save_pretrained(folder)
    compressor.update_config(folder)
    stored = {n: (m.weight.data.clone(), m.weight_scale.data.clone()) for n, m in model.named_modules()
              if hasattr(m, "weight_scale")}
    compressor.decompress_model(model)
    for m in model.modules():  # (no activation quantization: fastmamba's products take float32 activations)
        m.quantization_enabled = False
    assert ct.__version__
    return {n: m.weight.data.float() for n, m in model.named_modules() if n in stored}, stored


def tiny_mamba(**kw):
    torch.manual_seed(0)
    config = transformers.MambaConfig(hidden_size=16, num_hidden_layers=2, state_size=16, vocab_size=101,
                                      tie_word_embeddings=False, **kw)
    return transformers.MambaForCausalLM(config).eval()


MATRICES = ("in_proj", "x_proj", "dt_proj", "out_proj")


@pytest.mark.parametrize("strategy, block, static_inputs, ignore", [
    ("channel", None, False, ()),  # the head quantized too; format naive-quantized (the library's pick)
    ("tensor", None, True, ("lm_head",)),  # static input scales (read, unused); the head left 32-bit
    ("block", (8, 8), False, ("lm_head",)),  # x_proj's 33 rows and dt_proj's 1 column: blocks cut short
])
def test_a_compressed_tensors_checkpoint_loads_as_the_library_decompresses_it(tmp_path, strategy, block,
                                                                               static_inputs, ignore):
    model = tiny_mamba()
    x = torch.randint(0, 101, (2, 17), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(x).logits
    decompressed, stored = compress(model, tmp_path, strategy, block, static_inputs, ignore)
    q = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert q["quant_method"] == "compressed-tensors" and q["config_groups"]["group_0"]["weights"]["strategy"] == strategy
    lm = fastmamba.load(tmp_path, dtype="fp8")
    w = lm.model.weights
    for i, lw in enumerate(w.layers):
        for m in MATRICES:
            got, name = getattr(lw, m + "_w"), f"backbone.layers.{i}.mixer.{m}"
            assert isinstance(got, Fp8Weight) and got.block == block
            assert torch.equal(got.data.view(torch.uint8), stored[name][0].view(torch.uint8))  # not requantized
            if strategy == "tensor":  # the one scale, each row's
                assert torch.equal(got.scale, stored[name][1].float().expand(got.shape[0]))
            assert torch.equal(got.dequantize(), decompressed[name]), name
    if "lm_head" in ignore:
        assert w.lm_head.dtype == torch.float32 and torch.equal(w.lm_head, model.lm_head.weight.float())
    else:
        assert torch.equal(w.lm_head.dequantize(), decompressed["lm_head"])
    # the same checkpoint under float32: the library's dequantized weights, exactly
    dense = fastmamba.load(tmp_path).model.weights.layers[1]
    assert torch.equal(dense.in_proj_w, decompressed["backbone.layers.1.mixer.in_proj"])
    # the logits: transformers' model of the library's decompressed weights, and the unquantized model's
    with torch.no_grad():
        assert relative_error(lm.forward(x), model(x).logits) < 1e-5
    assert relative_error(lm.forward(x), ref) < FP8_OVER_BF16 * relative_error(
        fastmamba.load(tmp_path, dtype="bfloat16").forward(x), model(x).logits.detach()) + 1e-2


def test_a_compressed_tensors_falcon_h1_folds_its_multipliers_into_the_scales(tmp_path):
    """Falcon-H1's muP multipliers scale sections of in_proj's rows and whole matrices: an FP8
    checkpoint's are folded into its scales (channel and 8-row blocks): the logits of
    transformers' model of the library's decompressed weights (which applies them itself)."""
    from test_hybrids import falcon

    config, model_class = falcon(mamba_rms_norm=False)
    torch.manual_seed(0)
    x = torch.randint(0, 160, (2, 21), generator=torch.Generator().manual_seed(2))
    for strategy, block in (("channel", None), ("block", (8, 8)), ("block", (128, 128))):
        folder = tmp_path / f"{strategy}{block and block[0]}"
        model = model_class(config).eval()
        compress(model, folder, strategy, block, ignore=("lm_head",))
        lm = fastmamba.load(folder, dtype="fp8")
        # (sections of in_proj that are not whole 128-row blocks: its values as float32, not a refusal)
        want = block if block != (128, 128) else None
        assert getattr(lm.model.weights.layers[0].mamba.in_proj_w, "block", None) == want
        with torch.no_grad():
            assert relative_error(lm.forward(x), model(x).logits) < 1e-5
            assert relative_error(fastmamba.load(folder).forward(x), model(x).logits) < 1e-5


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fp8")
    compress(tiny_mamba(), folder, "channel")
    return folder


def edited(folder, tmp_path, config=None, tensors=None, files=None):
    import shutil

    from safetensors.torch import load_file, save_file

    out = tmp_path / "edited"
    shutil.copytree(folder, out)
    if config:
        cfg = json.loads((out / "config.json").read_text())
        config(cfg["quantization_config"])
        (out / "config.json").write_text(json.dumps(cfg))
    if tensors:
        t = load_file(str(out / "model.safetensors"))
        tensors(t)
        save_file(t, str(out / "model.safetensors"))
    for name, text in (files or {}).items():
        (out / name).write_text(text)
    return out


def weights_of(q):
    return q["config_groups"]["group_0"]["weights"]


S = "backbone.layers.0.mixer.in_proj."
REFUSED = {  # an edit of the checkpoint -> what the error names
    "int8 weights": (dict(config=lambda q: weights_of(q).update(type="int")), ["weights.type", "'int'"]),
    "int4 weights": (dict(config=lambda q: weights_of(q).update(num_bits=4)), ["weights.num_bits", "4"]),
    "groups": (dict(config=lambda q: weights_of(q).update(strategy="group", group_size=None)),
               ["weights.strategy", "'group'"]),
    "asymmetric": (dict(config=lambda q: weights_of(q).update(symmetric=False)), ["weights.symmetric", "False"]),
    "packed format": (dict(config=lambda q: q.update(format="pack-quantized")), ["quantization_config.format",
                                                                                "pack-quantized"]),
    "another quant_method": (dict(config=lambda q: q.update(quant_method="gptq")),
                             ["quantization_config.quant_method", "'gptq'", "'modelopt'"]),
    "modelopt's NVFP4 in config.json": (dict(config=lambda q: q.update(quant_method="modelopt", quant_algo="NVFP4")),
                                        ["quantization_config.quant_algo", "'NVFP4'"]),
    "a KV cache scheme": (dict(config=lambda q: q.update(kv_cache_scheme={"num_bits": 8})), ["kv_cache_scheme"]),
    "e5m2 values": (dict(tensors=lambda t: t.update({S + "weight": t[S + "weight"].float().to(torch.float8_e5m2)})),
                    [S + "weight", "f8_e5m2"]),
    "a missing scale": (dict(tensors=lambda t: t.pop(S + "weight_scale")), ["missing tensor", S + "weight_scale"]),
    "a scale of the wrong shape": (dict(tensors=lambda t: t.update({S + "weight_scale": torch.ones(3, 1)})),
                                   [S + "weight_scale", "(3, 1)", "(64, 1) (channel)"]),
    "an activation scale the scheme has not": (dict(tensors=lambda t: t.update({S + "input_scale": torch.ones(1)})),
                                               ["unexpected tensor", S + "input_scale"]),
    "int8 activations": (dict(config=lambda q: q["config_groups"]["group_0"].update(input_activations=dict(
        num_bits=8, type="int", symmetric=True, dynamic=True))), ["input_activations.type", "'int'"]),
    "fp4 activations": (dict(config=lambda q: q["config_groups"]["group_0"].update(input_activations=dict(
        num_bits=4, type="float", strategy="tensor_group", dynamic=True))), ["input_activations.num_bits", "4"]),
    "asymmetric activations": (dict(config=lambda q: q["config_groups"]["group_0"].update(input_activations=dict(
        num_bits=8, type="float", symmetric=False, dynamic=True))), ["input_activations.symmetric", "False"]),
}


def test_a_preset_group_and_dynamic_fp8_activations_load(fp8_checkpoint, tmp_path):
    """compressed-tensors' preset name with its targets (FP8_DYNAMIC: a scale a channel), and a
    group's dynamic FP8 activations: read as the group's weights say."""
    want = fastmamba.load(fp8_checkpoint).forward(torch.tensor([[1, 2, 3, 4]]))
    preset = edited(fp8_checkpoint, tmp_path / "preset", config=lambda q: q.update(config_groups={"FP8_DYNAMIC": ["Linear"]}))
    acts = edited(fp8_checkpoint, tmp_path / "acts", config=lambda q: q["config_groups"]["group_0"].update(
        input_activations=dict(num_bits=8, type="float", strategy="token", dynamic=True)))
    for folder in (preset, acts):
        assert torch.equal(fastmamba.load(folder).forward(torch.tensor([[1, 2, 3, 4]])), want)


@pytest.mark.parametrize("case", list(REFUSED))
def test_other_schemes_are_refused_by_name(fp8_checkpoint, tmp_path, case):
    edit, fragments = REFUSED[case]
    with pytest.raises(fastmamba.CheckpointError) as info:
        fastmamba.load(edited(fp8_checkpoint, tmp_path, **edit), dtype="fp8")
    for f in fragments:
        assert f in str(info.value), (f, str(info.value))


# -- the command line ---------------------------------------------------------------------------


def test_the_command_line_generates_with_fp8(bundled):
    r = subprocess.run([sys.executable, "-m", "fastmamba.cli", "generate", "--dtype", "fp8", "--max-tokens", "12",
                        "To be, or not to be"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout == bundled["fp8"].generate("To be, or not to be", max_tokens=12).text + "\n"
