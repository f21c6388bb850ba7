"""Mamba-2 (SSD) checkpoints on the reference engine, against transformers' Mamba2ForCausalLM
in float32: tiny random checkpoints written by save_pretrained, and the original
state-spaces format."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import assert_within_transformers_16bit_error, relative_error
from safetensors.torch import load_file, save_file

import fastmamba
from fastmamba.core.sampling_params import SamplingParams
from fastmamba.engine.engine_core import EngineCore
from fastmamba.engine.protocol import Finished, Request, Token

transformers = pytest.importorskip("transformers")


def hf_groups_the_norm() -> bool:
    """Whether this transformers' Mamba2 normalizes the gated norm per group, as mamba_ssm
    defines it. Older versions normalize over all of d_inner whatever n_groups (fixed by
    transformers PR 40861): with n_groups > 1 they are no oracle."""
    from transformers.models.mamba2 import modeling_mamba2

    return hasattr(modeling_mamba2, "Mamba2RMSNormGated")


def needs_grouped_hf(n_groups: int) -> None:
    if n_groups > 1 and not hf_groups_the_norm():
        pytest.skip(f"transformers {transformers.__version__} normalizes Mamba-2's gated norm over all "
                    "groups (no oracle for n_groups > 1)")

CONFIGS = {  # chunk_size below the prompts' lengths, so prefill crosses chunks
    "one_group_tied": dict(n_groups=1, tie_word_embeddings=True),
    "two_groups_untied": dict(n_groups=2, tie_word_embeddings=False, use_conv_bias=False),
    "four_groups_bias_kernel3": dict(n_groups=4, use_bias=True, conv_kernel=3, state_size=8),
}


def save_mamba2(folder, seed: int = 0, **overrides):
    from transformers import Mamba2Config, Mamba2ForCausalLM

    args = dict(hidden_size=64, num_hidden_layers=2, vocab_size=97, state_size=16, head_dim=16, num_heads=8,
                n_groups=1, chunk_size=8, expand=2)
    args.update(overrides)
    torch.manual_seed(seed)
    model = Mamba2ForCausalLM(Mamba2Config(**args)).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # spread what the init leaves constant, so a misread tensor shows
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", "norm_f.weight", "mixer.D")):
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
            elif name.endswith(("dt_bias", "A_log")) or (name.endswith("bias") and "conv1d" in name):
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    model.save_pretrained(str(folder))
    return folder, model


@pytest.fixture(scope="module", params=list(CONFIGS))
def case(request, tmp_path_factory):
    folder, model = save_mamba2(tmp_path_factory.mktemp("m2") / request.param, **CONFIGS[request.param])
    return folder, model


def ids(n: int = 2, t: int = 21, vocab: int = 97, seed: int = 3) -> torch.Tensor:
    return torch.randint(0, vocab, (n, t), generator=torch.Generator().manual_seed(seed))


def test_float32_logits_equal_transformers(case):
    folder, model = case
    needs_grouped_hf(model.config.n_groups)
    x = ids()
    with torch.no_grad():
        ref = model(x).logits
    assert relative_error(fastmamba.load(folder).forward(x), ref) < 1e-5


def test_greedy_equals_transformers_greedy(case):
    folder, model = case
    needs_grouped_hf(model.config.n_groups)
    x = ids(1, 13)
    with torch.no_grad():
        want = model.generate(x, max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0)[0, 13:].tolist()
    assert fastmamba.load(folder).generate(x[0].tolist(), max_tokens=16, stop_token_ids=[]).token_ids == want


def test_step_by_step_decode_equals_the_sequence_pass(case):
    folder, _ = case
    model = fastmamba.load(folder).model
    x = ids(2, 19)
    whole = model.forward(x)
    state = model.new_state(2)
    steps = [model.prefill(x[:, :5], state)]  # a prefill, then one token at a time
    steps += [model.step(x[:, t], state)[:, None] for t in range(5, 19)]
    torch.testing.assert_close(torch.cat(steps, 1), whole, rtol=1e-5, atol=1e-5)


def test_a_batch_gives_each_prompt_what_it_gets_alone(case):
    """Left-padded batched prefill (shorter prompts padded), then decode together."""
    folder, _ = case
    lm = fastmamba.load(folder)
    prompts = [ids(1, n, seed=n)[0].tolist() for n in (3, 17, 9)]
    params = [SamplingParams(max_tokens=10, temperature=0.9 * (k % 2), seed=k, stop_token_ids=[]) for k in range(3)]
    together = lm.generate_batch(prompts, params)
    for p, q, g in zip(prompts, params, together):
        assert g.token_ids == lm.generate(p, q).token_ids


def check_engine_paths(lm, reference) -> None:
    """The serving engine's paths on `lm`: prompts in 8-token chunks, then a cached prefix
    resumed; each request's tokens what `reference` generates alone."""
    core = EngineCore(lm.model, lm.prefill, max_batch=2, prefill_tokens=8, prefix_cache_bytes=16 << 20)
    first = ids(1, 20, seed=7)[0].tolist()
    reqs = [Request(0, first, SamplingParams(max_tokens=6, stop_token_ids=[])),
            Request(1, first + [5, 6, 7], SamplingParams(max_tokens=6, stop_token_ids=[]))]
    got = {}
    for r in reqs:
        core.add(r)
        while core.has_work:
            for out in core.step():
                got.setdefault(out.rid, [[], None])
                if isinstance(out, Token):
                    got[out.rid][0].append(out.token)
                else:
                    assert isinstance(out, Finished), out
                    got[out.rid][1] = out
    for r in reqs:
        assert got[r.rid][0] == reference.generate(r.ids, max_tokens=6, stop_token_ids=[]).token_ids
    assert got[reqs[1].rid][1].cached_tokens >= len(first)


def test_the_engine_with_chunks_and_the_prefix_cache(case):
    folder, _ = case
    lm = fastmamba.load(folder)
    check_engine_paths(lm, lm)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_16bit_storage_within_transformers_own_error(tmp_path, dtype):
    needs_grouped_hf(2)
    folder, _ = save_mamba2(tmp_path / "m", n_groups=2)
    x = ids(2, 21)
    assert_within_transformers_16bit_error(fastmamba.load(folder, dtype=dtype).forward(x), folder, x, dtype)


def test_the_original_format_loads(tmp_path):
    """state-spaces' layout: d_model / n_layer / ssm_cfg {layer: Mamba2}, a vocab padded up
    to pad_vocab_size_multiple, `backbone.embedding.weight`, pytorch_model.bin."""
    needs_grouped_hf(2)
    hf, model = save_mamba2(tmp_path / "hf", n_groups=2, vocab_size=90, tie_word_embeddings=True)
    tensors = load_file(hf / "model.safetensors")
    emb = tensors.pop("backbone.embeddings.weight")
    padded = torch.cat([emb, torch.zeros(6, emb.shape[1])])  # 90 -> 96
    tensors["backbone.embedding.weight"] = padded
    orig = tmp_path / "orig"
    orig.mkdir()
    torch.save(tensors, orig / "pytorch_model.bin")
    (orig / "config.json").write_text(json.dumps(dict(
        d_model=64, n_layer=2, vocab_size=90, pad_vocab_size_multiple=16, rms_norm=True, tie_embeddings=True,
        ssm_cfg=dict(layer="Mamba2", d_state=16, headdim=16, ngroups=2, chunk_size=8, expand=2))))
    lm = fastmamba.load(orig)
    assert lm.config.vocab_size == 96 and lm.config.layer == "mamba2"
    x = ids(2, 21, vocab=90)
    with torch.no_grad():
        ref = model(x).logits
    assert relative_error(lm.forward(x)[..., :90], ref) < 1e-5


def test_a_config_saying_norm_before_gate_runs_as_transformers_runs_it(tmp_path):
    """transformers 4.44's Mamba2Config wrote `norm_before_gate: true` (its default then, and in
    Codestral's config.json); its model gates before the norm whatever the key says."""
    folder, model = save_mamba2(tmp_path / "m")
    config = json.loads((folder / "config.json").read_text())
    config["norm_before_gate"] = True
    (folder / "config.json").write_text(json.dumps(config))
    x = ids()
    with torch.no_grad():
        ref = model(x).logits
    assert relative_error(fastmamba.load(folder).forward(x), ref) < 1e-5


def test_a_misshapen_tensor_is_named(tmp_path):
    folder, _ = save_mamba2(tmp_path / "m", n_groups=2)
    tensors = load_file(folder / "model.safetensors")
    tensors["backbone.layers.1.mixer.A_log"] = torch.zeros(9)
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(fastmamba.CheckpointError, match=r"'backbone\.layers\.1\.mixer\.A_log' has shape \(9,\)"):
        fastmamba.load(folder)


@pytest.mark.parametrize("edit,says", [
    (dict(num_heads=7), "num_heads"),
    (dict(n_groups=3), "n_groups"),
    (dict(hidden_act="gelu"), "'hidden_act' is 'gelu'"),
    (dict(time_step_limit=[0.5, 0.1]), "time_step_limit"),
    (dict(head_dim=24), "head_dim"),
    (dict(chunk_size=10**12), "chunk size .* is 1000000000000"),
])
def test_config_fields_are_checked_by_name(tmp_path, edit, says):
    folder, _ = save_mamba2(tmp_path / "m")
    config = json.loads((folder / "config.json").read_text())
    config.update(edit)
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(fastmamba.CheckpointError, match=says):
        fastmamba.load(folder)


# -- the GPU engine's kernels (Triton's interpreter without CUDA) ---------------------------

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("G,H,P,N,state_dtype,limit", [
    (1, 4, 16, 16, "float32", (0.0, float("inf"))),
    (2, 6, 24, 12, "bfloat16", (0.05, 0.6)),  # P past one program, N not a power of two, dt clamped
    (3, 3, 8, 5, "float32", (0.0, 0.3)),
])
def test_the_step_kernel_equals_its_twin(G, H, P, N, state_dtype, limit):
    pytest.importorskip("triton")
    from fastmamba.engine.plan import SSD_TILES
    from fastmamba.kernels.ssd import ssd_scan, ssd_scan_ref

    g = torch.Generator().manual_seed(H * P)
    r = lambda *s: torch.randn(*s, generator=g).to(DEVICE)  # noqa: E731
    B, E = 3, H * P
    buf = r(B, 1, E + 2 * G * N + 7)  # the conv's output as the layer has it: x, B, C side by side (and more)
    x, Bm, Cm = buf[..., :E].unflatten(-1, (H, P)), buf[..., E:E + G * N].unflatten(-1, (G, N)), \
        buf[..., E + G * N:E + 2 * G * N].unflatten(-1, (G, N))
    dt = r(B, 1, H + 3)[..., 1:H + 1]  # a view, as in_proj's output
    dt_bias, A, D = r(H), -torch.rand(H, generator=g).to(DEVICE) - 0.5, r(H)
    dtype = getattr(torch, state_dtype)
    state = r(B, H, P, N).to(dtype)
    ours, ref = state.clone(), state.clone()
    y = ssd_scan(x, dt, dt_bias, limit, A, Bm, Cm, D, ours, 4, tiles=SSD_TILES)
    y_ref = ssd_scan_ref(x, dt, dt_bias, limit, A, Bm, Cm, D, ref, 4)
    tol = 1e-5 if DEVICE == "cpu" else 1e-4
    assert relative_error(y, y_ref) < tol
    assert relative_error(ours.float(), ref.float()) < (tol if dtype == torch.float32 else 1e-2)
    assert not torch.equal(ours.float(), state.float())


def reset_flags(B: int, T: int, at) -> torch.Tensor:
    """(B, T) bool: resets at the positions `at` of each row (row b's shifted by b)."""
    resets = torch.zeros(B, T, dtype=torch.bool)
    for b in range(B):
        for t in at:
            resets[b, min(T - 1, t + b)] = True
    return resets


@pytest.mark.parametrize("chunk", [4, 7, 64])
def test_the_reference_scan_with_resets_equals_the_recurrence(chunk):
    """ssd_scan_ref's chunked form against the plain recurrence, step by step, where a reset
    zeroes the state before its step: resets at the first step, on and inside chunk
    boundaries, twice in one chunk, and at the last step."""
    from fastmamba.kernels.ssd import ssd_scan_ref, step_sizes_ref

    g = torch.Generator().manual_seed(chunk)
    B, T, G, H, P, N = 2, 23, 2, 4, 3, 5
    x, dt = torch.randn(B, T, H, P, generator=g), torch.randn(B, T, H, generator=g)
    Bm, Cm = torch.randn(B, T, G, N, generator=g), torch.randn(B, T, G, N, generator=g)
    dt_bias, D, A = 0.3 * torch.randn(H, generator=g), torch.randn(H, generator=g), -torch.rand(H, generator=g) - 0.3
    state = torch.randn(B, H, P, N, generator=g)
    resets = reset_flags(B, T, [0, 4, 8, 9, 14, 22])
    got_state = state.clone()
    got = ssd_scan_ref(x, dt, dt_bias, (0.0, float("inf")), A, Bm, Cm, D, got_state, chunk, resets=resets)
    delta = step_sizes_ref(dt, dt_bias, (0.0, float("inf")))
    s, want = state.clone(), []
    for t in range(T):
        s = s * ~resets[:, t, None, None, None]
        Bh, Ch = (v[:, t].repeat_interleave(H // G, dim=1) for v in (Bm, Cm))  # (B, H, N)
        s = s * torch.exp(delta[:, t] * A)[..., None, None] + (delta[:, t, :, None] * x[:, t])[..., None] * Bh[:, :, None]
        want.append((s * Ch[:, :, None]).sum(-1) + D[:, None] * x[:, t])
    assert relative_error(got, torch.stack(want, 1)) < 1e-5
    assert relative_error(got_state, s) < 1e-5


@pytest.mark.parametrize("T,G,H,P,N,dtype,start,resets", [
    (9, 2, 4, 16, 16, "float32", None, None),  # one short chunk
    (700, 2, 4, 8, 12, "float32", [0, 37], None),  # three chunks, the last partial; left padding; P, N below a tile
    (300, 1, 2, 16, 16, "bfloat16", None, None),  # 16-bit operands
    (600, 2, 4, 8, 12, "float32", None, [0, 100, 255, 256, 300, 310, 599]),  # resets: first step, a chunk's
    # last and first, two in a chunk, the last step
    (40, 1, 2, 16, 16, "float32", [0, 5], [3, 20]),  # resets and left padding in one short chunk
    (1, 2, 4, 16, 16, "float32", None, [0]),  # a one-step pass that resets: the chunked kernels, not the step's
])
# C B^T in each head's program, or once a group; the state passing's chunks at a time: all
# of them at once, or 2 (blocks in turn, the last partial where there are 3 chunks)
@pytest.mark.parametrize("cb_once,pass_cb", [(False, 32), (True, 2)])
def test_the_chunked_scan_kernels_equal_their_twin(T, G, H, P, N, dtype, start, resets, cb_once, pass_cb):
    pytest.importorskip("triton")
    from dataclasses import replace

    from fastmamba.engine.plan import SSD_TILES
    from fastmamba.kernels.ssd import ssd_scan, ssd_scan_ref

    tiles = replace(SSD_TILES, cb_once=cb_once, pass_cb=pass_cb)

    g = torch.Generator().manual_seed(T)
    r = lambda *s: torch.randn(*s, generator=g).to(DEVICE)  # noqa: E731
    B = 2 if start or resets else 1
    buf = r(B, T, H * P + 2 * G * N).to(getattr(torch, dtype))  # x, B, C side by side, as the conv writes them
    x = buf[..., :H * P].unflatten(-1, (H, P))
    Bm, Cm = (buf[..., H * P + k * G * N:H * P + (k + 1) * G * N].unflatten(-1, (G, N)) for k in (0, 1))
    dt = (r(B, T, H + 3) - 1)[..., 1:H + 1]  # in_proj's raw step sizes: a view, its rows wider than H
    dt_bias, A, D = 0.3 * r(H), -torch.rand(H, generator=g).to(DEVICE) - 0.3, r(H)
    state = r(B, H, P, N)
    ours, ref = state.clone(), state.clone()
    # the cases with left padding also clamp the step sizes (both bounds bind on these draws)
    limit = (0.2, 1.0) if start else (0.0, float("inf"))
    start = torch.tensor(start, dtype=torch.int32, device=DEVICE) if start else None
    resets = reset_flags(B, T, resets).to(DEVICE) if resets else None
    y = ssd_scan(x, dt, dt_bias, limit, A, Bm, Cm, D, ours, 8, start, resets, tiles=tiles)
    y_ref = ssd_scan_ref(x, dt, dt_bias, limit, A, Bm, Cm, D, ref, 8, start, resets)
    tol = 1e-2 if dtype == "bfloat16" else (1e-5 if DEVICE == "cpu" else 1e-4)
    assert relative_error(y, y_ref) < tol and relative_error(ours, ref) < tol


@pytest.mark.parametrize("gpu_ops", [False, True])
def test_a_layer_with_resets_runs_each_segment_from_a_zero_state(tmp_path, gpu_ops):
    """mixer2 over a sequence with resets equals the layer over each segment alone, from zero
    conv and ssm states (the reference ops, and the GPU ops: the Triton conv and SSD)."""
    if gpu_ops:
        pytest.importorskip("triton")
    from fastmamba.core.mamba2 import mixer2
    from fastmamba.core.ops import REFERENCE_OPS, triton_ops
    from fastmamba.engine.plan import KERNEL_TILES

    folder, _ = save_mamba2(tmp_path / "m", n_groups=2)
    model = fastmamba.load(folder, device=DEVICE).model
    ops = triton_ops(KERNEL_TILES) if gpu_ops else REFERENCE_OPS
    c, lw = model.config, model.weights.layers[1]
    T, cuts = 30, [0, 9, 10, 24]  # a reset at the first step, chunks of 8: on and inside their edges
    u = torch.randn(1, T, c.d_model, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    resets = torch.zeros(1, T, dtype=torch.bool, device=DEVICE)
    resets[0, cuts] = True
    state = model.new_state(1)
    state.conv.normal_(), state.ssm.normal_()  # (the first reset must discard them)
    got = mixer2(c, lw, u, state.conv[1], state.ssm[1], ops, resets=resets)
    for a, b in zip(cuts, cuts[1:] + [T]):
        alone = model.new_state(1)
        want = mixer2(c, lw, u[:, a:b], alone.conv[1], alone.ssm[1], ops)
        assert relative_error(got[:, a:b], want) < 1e-4
    assert relative_error(state.ssm[1], alone.ssm[1]) < 1e-4 and relative_error(state.conv[1], alone.conv[1]) < 1e-4


@pytest.mark.parametrize("groups,before,out_dtype", [(1, False, "float32"), (4, False, "bfloat16"), (2, True, "float32")])
def test_the_gated_norm_kernel_equals_its_twin(groups, before, out_dtype):
    pytest.importorskip("triton")
    from fastmamba.kernels.gated_norm import gated_rmsnorm, gated_rmsnorm_ref

    g = torch.Generator().manual_seed(groups)
    E = 48
    zy = torch.randn(2, 5, 3 * E, generator=g).to(DEVICE)
    z, y = zy[..., :E], zy[..., E:2 * E]  # views with their rows apart, as in_proj's output
    w = (1 + 0.3 * torch.randn(E, generator=g)).to(DEVICE)
    dtype = getattr(torch, out_dtype)
    out = gated_rmsnorm(y, z, w, groups, 1e-5, before, dtype)
    assert out.dtype == dtype and out.shape == y.shape
    ref = gated_rmsnorm_ref(y, z, w, groups, 1e-5, before)
    assert relative_error(out.float(), ref) < (1e-5 if dtype == torch.float32 else 1e-2)


# take_turns: the one-row step and the plan's take turns on one state, as when the engine
# decodes a slot at batch 1 and then in a larger bucket, or back (both read and write the
# same state layout)
@pytest.mark.parametrize("deterministic,take_turns", [(False, False), (True, False), (False, True)])
def test_the_gpu_engines_model_equals_the_reference(tmp_path, monkeypatch, deterministic, take_turns):
    """The model over the GPU ops (cuBLAS products, or invariant_gemm's; the Triton conv,
    norms and scan step) against the reference: a prefill, then decode steps through the
    decode plan's step (or it and the one-row step in turn): logits and both states."""
    pytest.importorskip("triton")
    from fastmamba.core.model import Mamba
    from fastmamba.core.ops import triton_ops
    from fastmamba.engine.decode_step import make_decode_step
    from fastmamba.engine.plan import KERNEL_TILES, DecodePlan
    from fastmamba.kernels import ssd

    folder, _ = save_mamba2(tmp_path / "m", n_groups=2, use_bias=True)
    ref = fastmamba.load(folder).model
    ours = Mamba(ref.config, fastmamba.load(folder, device=DEVICE).model.weights, triton_ops(KERNEL_TILES))
    step = make_decode_step(ours, 2, deterministic)
    assert step.plan.step == "layer-ops" and bool(step.plan.cublas) != deterministic
    steps = [step]
    if take_turns:
        steps.insert(0, make_decode_step(ours, 2, plan=DecodePlan("one-row")))
        assert type(steps[0]).__name__ == "Mamba2DecodeStep"
    x = ids(2, 15)
    s_ref, s_ours = ref.new_state(2), ours.new_state(2)
    want = [ref.prefill(x[:, :9], s_ref, last_only=True)] + [ref.step(x[:, t], s_ref) for t in range(9, 15)]
    got = [ours.prefill(x[:, :9].to(DEVICE), s_ours, last_only=True)]
    with monkeypatch.context() as m:  # the steps take the step kernel, not the reference scan
        m.setattr(ssd, "ssd_scan_ref", lambda *a, **k: pytest.fail("a decode step fell back to ssd_scan_ref"))
        # (clones: the one-row step's logits are a view of its buffer, rewritten each call)
        got += [steps[t % len(steps)](x[:, t].to(DEVICE), s_ours).clone() for t in range(9, 15)]
    for a, b in zip(got, want):
        assert relative_error(a.cpu(), b) < 1e-4
    assert relative_error(s_ours.ssm.cpu(), s_ref.ssm) < 1e-4 and relative_error(s_ours.conv.cpu(), s_ref.conv) < 1e-4


@pytest.mark.parametrize("overrides,before,state_dtype,in_proj_rows", [
    (dict(n_groups=2, use_bias=True), False, "float32", None),
    # P = 24 (past one program, not a power of two), N = 12, a 3-tap conv, four groups;
    # in_proj 32 rows a program (2.7b's plan), the last program partly past its rows
    (dict(hidden_size=48, head_dim=24, num_heads=4, n_groups=4, conv_kernel=3, state_size=12), True, "bfloat16", 32),
])
def test_the_one_row_step_equals_the_reference(tmp_path, overrides, before, state_dtype, in_proj_rows):
    """Mamba-2's one-row step (kernels/decode_step_mamba2.py: in_proj, the conv + SSD step,
    the gated norm + out_proj, three kernels a layer) against the reference model's steps,
    logits and both states; and a row's logits the same bits alone as in a batch."""
    pytest.importorskip("triton")
    from dataclasses import replace

    from fastmamba.core.model import Mamba
    from fastmamba.core.ops import triton_ops
    from fastmamba.engine.decode_step import make_decode_step
    from fastmamba.engine.plan import KERNEL_TILES, DecodePlan, one_row_blocks

    folder, _ = save_mamba2(tmp_path / "m", **overrides)
    loaded = fastmamba.load(folder).model
    config, sd = replace(loaded.config, norm_before_gate=before), getattr(torch, state_dtype)
    ref = Mamba(config, loaded.weights, state_dtype=sd)
    ours = Mamba(config, fastmamba.load(folder, device=DEVICE).model.weights, triton_ops(KERNEL_TILES), state_dtype=sd)
    plan = DecodePlan("one-row")
    if in_proj_rows:
        blocks = one_row_blocks(config.d_model, config.d_inner, config.vocab_size, torch.float32, "mamba2")
        plan = DecodePlan("one-row", blocks=replace(blocks, in_proj=(in_proj_rows, *blocks.in_proj[1:])))
        assert (2 * config.d_inner + 2 * config.n_groups * config.d_state + config.n_heads) % in_proj_rows
    step = make_decode_step(ours, 3, plan=plan)
    assert type(step).__name__ == "Mamba2DecodeStep" and step.in_proj_blocks[0] == (in_proj_rows or 16)
    x = ids(3, 14)
    s_ref, s_ours = ref.new_state(3), ours.new_state(3)
    want = [ref.prefill(x[:, :9], s_ref, last_only=True)] + [ref.step(x[:, t], s_ref) for t in range(9, 14)]
    got = [ours.prefill(x[:, :9].to(DEVICE), s_ours, last_only=True)]
    alone_state = ours.new_state(1)
    alone_state.conv.copy_(s_ours.conv[:, 1:2]), alone_state.ssm.copy_(s_ours.ssm[:, 1:2])
    got += [step(x[:, t].to(DEVICE), s_ours).clone() for t in range(9, 14)]
    tol = 1e-4 if sd == torch.float32 else 2e-2  # (a bf16 state rounds at each store, in either order of sums)
    for a, b in zip(got, want):
        assert relative_error(a.cpu(), b) < tol
    assert relative_error(s_ours.ssm.cpu(), s_ref.ssm) < tol and relative_error(s_ours.conv.cpu(), s_ref.conv) < tol
    one = make_decode_step(ours, 1, plan=plan)
    alone = [one(x[1:2, t].to(DEVICE), alone_state).clone() for t in range(9, 14)]
    assert all(torch.equal(a[0], b[1]) for a, b in zip(alone, got[1:]))


# out_proj's K tiles: the default (512, wider than a group: each column's group's scale) or
# 16 (inside one group of 64 channels: one scale a tile)
@pytest.mark.parametrize("before,out_tile", [(False, None), (True, None), (False, 16)])
def test_the_one_row_kernels_equal_their_twins(tmp_path, before, out_tile):
    """ssd_conv_step and gated_out_proj alone, on one layer and random inputs, against
    ssd_conv_step_ref and gated_out_proj_ref: v, both states, the residual's fold and dh."""
    pytest.importorskip("triton")
    from dataclasses import replace

    from fastmamba.core.model import Mamba
    from fastmamba.core.ops import triton_ops
    from fastmamba.engine.decode_step import make_decode_step
    from fastmamba.engine.plan import KERNEL_TILES, DecodePlan, one_row_blocks
    from fastmamba.kernels.decode_step_mamba2 import (
        gated_out_proj_ref,
        ssd_conv_step_ref,
    )
    from fastmamba.kernels.gemv import from_fixed, to_fixed

    folder, _ = save_mamba2(tmp_path / "m", n_groups=2, use_bias=True, use_conv_bias=True)
    loaded = fastmamba.load(folder, device=DEVICE).model
    model = Mamba(replace(loaded.config, norm_before_gate=before), loaded.weights, triton_ops(KERNEL_TILES))
    c, lw = model.config, model.weights.layers[0]
    blocks = one_row_blocks(c.d_model, c.d_inner, c.vocab_size, torch.float32)
    if out_tile:
        blocks = replace(blocks, out_proj=(8, out_tile, 4, 640))
    step = make_decode_step(model, 2, plan=DecodePlan("one-row", blocks=blocks))
    assert (c.d_inner // c.n_groups) % step.BK_out == 0 if out_tile else step.BK_out > c.d_inner // c.n_groups
    g = torch.Generator().manual_seed(7)
    r = lambda *s: torch.randn(*s, generator=g).to(DEVICE)  # noqa: E731
    step.zxbcdt.copy_(r(*step.zxbcdt.shape))
    state = model.new_state(2)
    state.conv.copy_(r(*state.conv.shape)), state.ssm.copy_(r(*state.ssm.shape))
    conv_ref, ssm_ref = state.conv[0].clone(), state.ssm[0].clone()
    h, dh = r(2, c.d_model), r(2, c.d_model)
    step.h[:2].copy_(h), step.dh[:2].copy_(to_fixed(dh))
    step.ssd_conv_step(lw, state.conv[0], state.ssm[0])
    v = ssd_conv_step_ref(step.zxbcdt.clone(), conv_ref, ssm_ref, lw, c)
    assert relative_error(step.y[:2], v) < 1e-5 and relative_error(state.ssm[0], ssm_ref) < 1e-5
    assert relative_error(step.h[:2], h + dh) < 1e-6 and not step.dh.any()  # the residual folded
    step.gated_out_proj(lw, state.conv[0])  # (shifts B's and C's windows: then the conv state is whole)
    assert relative_error(state.conv[0], conv_ref) < 1e-6
    assert relative_error(from_fixed(step.dh[:2]), gated_out_proj_ref(v, step.zxbcdt, lw, c)) < 1e-5


@pytest.mark.gpu
def test_mamba2_on_the_gpu_engine_equals_the_cpu(tmp_path):
    """The Triton engine on CUDA: logits, greedy decode, the serving engine's chunks and
    prefix cache, a bfloat16 state, and deterministic mode's batch invariance."""
    folder, _ = save_mamba2(tmp_path / "m", n_groups=2)
    gpu, cpu = fastmamba.load(folder, device="cuda"), fastmamba.load(folder)
    assert gpu.engine == "triton"
    x = ids(2, 21)
    torch.testing.assert_close(gpu.forward(x).cpu(), cpu.forward(x), rtol=1e-4, atol=1e-4)
    want = cpu.generate(x[0].tolist(), max_tokens=12, stop_token_ids=[]).token_ids
    assert gpu.generate(x[0].tolist(), max_tokens=12, stop_token_ids=[]).token_ids == want
    check_engine_paths(gpu, cpu)
    bf16 = fastmamba.load(folder, device="cuda", state_dtype="bfloat16")
    assert bf16.generate(x[0].tolist(), max_tokens=4, stop_token_ids=[]).token_ids == want[:4]
    det = fastmamba.load(folder, device="cuda", deterministic=True)
    prompts = [ids(1, n, seed=n)[0].tolist() for n in (3, 17, 9, 11)]
    params = [SamplingParams(max_tokens=8, temperature=0.8, seed=k, stop_token_ids=[]) for k in range(4)]
    together = det.generate_batch(prompts, params)
    for p, q, g in zip(prompts, params, together):
        assert g.token_ids == det.generate(p, q).token_ids


@pytest.mark.gpu
def test_the_one_row_step_as_the_gpu_engines_step(tmp_path):
    """Mamba-2's one-row step for every batch size (a plan given in place of the table's):
    the engine's CUDA graphs, greedy argmax inside, give the CPU's greedy tokens, alone and
    in a batch, and a float32 state and a bfloat16 one."""
    from fastmamba.engine.decode_step import make_decode_step
    from fastmamba.engine.plan import DecodePlan

    one_row = DecodePlan("one-row")
    folder, _ = save_mamba2(tmp_path / "m", n_groups=2, use_bias=True)
    gpu, cpu = fastmamba.load(folder, device="cuda"), fastmamba.load(folder)
    gpu.decode_plan = one_row
    assert type(make_decode_step(gpu.model, 4, plan=one_row)).__name__ == "Mamba2DecodeStep"
    prompts = [ids(1, n, seed=n)[0].tolist() for n in (3, 17, 9, 11)]
    want = [cpu.generate(p, max_tokens=12, stop_token_ids=[]).token_ids for p in prompts]
    assert gpu.generate(prompts[1], max_tokens=12, stop_token_ids=[]).token_ids == want[1]
    together = gpu.generate_batch(prompts, [SamplingParams(max_tokens=12, stop_token_ids=[])] * 4)
    assert [g.token_ids for g in together] == want
    bf16 = fastmamba.load(folder, device="cuda", state_dtype="bfloat16")
    bf16.decode_plan = one_row
    assert bf16.generate(prompts[1], max_tokens=4, stop_token_ids=[]).token_ids == want[1][:4]


def test_the_gpu_engines_16bit_numerics_within_transformers_own_error(tmp_path):
    """The GPU ops' bf16 path (the conv's output and the SSD's operands rounded to bf16), run
    here through Triton's interpreter, holds the 16-bit contract."""
    pytest.importorskip("triton")
    from fastmamba.core.model import Mamba
    from fastmamba.core.ops import triton_ops
    from fastmamba.engine.plan import KERNEL_TILES

    folder, _ = save_mamba2(tmp_path / "m", n_groups=1)
    x = ids(2, 40)
    weights = fastmamba.load(folder, device=DEVICE, dtype="bfloat16").model.weights
    model = Mamba(fastmamba.load(folder).config, weights, triton_ops(KERNEL_TILES))
    assert_within_transformers_16bit_error(model.forward(x.to(DEVICE)).cpu(), folder, x, "bfloat16")


@pytest.mark.gpu
def test_16bit_storage_on_the_gpu_engine_within_transformers_own_error(tmp_path):
    """The Triton engine's bf16 path (the conv's output and the SSD's operands in bf16)
    holds the 16-bit contract: within 1.25x transformers' own bf16 error."""
    folder, _ = save_mamba2(tmp_path / "m", n_groups=1)
    x = ids(2, 40)
    gpu = fastmamba.load(folder, device="cuda", dtype="bfloat16")
    assert gpu.engine == "triton"
    assert_within_transformers_16bit_error(gpu.forward(x).cpu(), folder, x, "bfloat16")


def test_a_masked_reset_zeroes_its_slots_of_a_five_dimensional_state(tmp_path):
    """MambaState.reset(mask) on Mamba-2's ssm state (L, B, H, P, N): the masked slots zeroed,
    the others untouched (with 2 slots and 2 heads a mask viewed for 4 dims would broadcast
    over the heads)."""
    folder, _ = save_mamba2(tmp_path / "m", hidden_size=64, head_dim=16, num_heads=8)
    model = fastmamba.load(folder).model
    state = model.new_state(3)
    state.conv.normal_()
    state.ssm.normal_()
    assert state.ssm.dim() == 5
    before = (state.conv.clone(), state.ssm.clone())
    state.reset(torch.tensor([False, True, False]))
    assert not state.conv[:, 1].any() and not state.ssm[:, 1].any()
    assert torch.equal(state.conv[:, [0, 2]], before[0][:, [0, 2]]) and torch.equal(state.ssm[:, [0, 2]], before[1][:, [0, 2]])
