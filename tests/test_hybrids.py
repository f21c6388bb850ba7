"""The hybrids (Nemotron-H, Bamba, Granite-4.0-H, Falcon-H1) on the reference engine, against
transformers' own classes: tiny checkpoints written by `save_pretrained`, with several Mamba
chunks, prompts longer than a KV block, GQA, RoPE (full, partial) and none, and each
family's multipliers."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import assert_within_transformers_16bit_error, relative_error, transformers_logits

import fastmamba
from fastmamba.core.sampling_params import SamplingParams
from fastmamba.core.state import MambaState
from fastmamba.engine.engine_core import EngineCore
from fastmamba.engine.protocol import Finished, Request, Token
from fastmamba.engine.warm_up import warm_up_prefill

transformers = pytest.importorskip("transformers")

V = 160
# The kernel tests are not `gpu`-marked: they run the kernels compiled where CUDA is, in
# Triton's interpreter (conftest) without it.
KERNELS_ON = "cuda" if torch.cuda.is_available() else "cpu"
MAMBA = dict(mamba_n_heads=8, mamba_d_state=16, mamba_n_groups=2, mamba_chunk_size=8)


def nemotron(**kw):
    return transformers.NemotronHConfig(
        vocab_size=V, hidden_size=64, layers_block_type=["mamba", "attention", "mlp", "mamba", "mlp"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=96, mamba_num_heads=8,
        mamba_head_dim=16, ssm_state_size=16, n_groups=2, chunk_size=8, **kw), transformers.NemotronHForCausalLM


def bamba(**kw):
    rope = {"rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 0.5}
    return transformers.BambaConfig(
        vocab_size=V, hidden_size=64, num_hidden_layers=3, attn_layer_indices=[1], num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=96, rope_parameters=rope, **MAMBA, **kw), transformers.BambaForCausalLM


def granite(position="rope", **kw):
    kw = {"attention_multiplier": 0.05, **kw}
    return transformers.GraniteMoeHybridConfig(
        vocab_size=V, hidden_size=64, num_hidden_layers=3, layer_types=["mamba", "attention", "mamba"],
        num_attention_heads=4, num_key_value_heads=1, shared_intermediate_size=96, num_local_experts=0,
        position_embedding_type=position, embedding_multiplier=6.0, logits_scaling=4.0, residual_multiplier=0.3,
        **MAMBA, **kw), transformers.GraniteMoeHybridForCausalLM


def falcon(**kw):
    return transformers.FalconH1Config(
        vocab_size=V, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=96, mamba_d_ssm=64, embedding_multiplier=2.0, lm_head_multiplier=0.5,
        key_multiplier=0.7, attention_in_multiplier=0.9, attention_out_multiplier=1.1, ssm_in_multiplier=0.8,
        ssm_out_multiplier=1.2, ssm_multipliers=[0.5, 0.6, 0.7, 0.8, 0.9], mlp_multipliers=[0.8, 0.9],
        **MAMBA, **kw), transformers.FalconH1ForCausalLM


CASES = {
    "nemotron_h": lambda: nemotron(),
    "bamba": lambda: bamba(),
    "granite_rope": lambda: granite(),
    "granite_nope_tied": lambda: granite("nope", tie_word_embeddings=True),
    "falcon_h1_ssm_norm": lambda: falcon(mamba_rms_norm=True),
    "falcon_h1": lambda: falcon(mamba_rms_norm=False),
}


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    return folder, save_case(request.param, folder)


def save_case(name: str, folder):
    """CASES[name]'s random model saved to `folder` (returned)."""
    config, model_class = CASES[name]()
    torch.manual_seed(0)
    model = model_class(config).eval()
    with torch.no_grad():  # (random biases and norms, so that each multiplier shows)
        for n, p in model.named_parameters():
            if "norm" in n:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(folder)
    return model


def run_until_done(core: EngineCore, got: dict, steps: int = 200) -> None:
    """Steps the engine until it has no work (at most `steps` steps), each Token's token
    appended to got[rid]; any output but a Token or a Finished fails the test."""
    for _ in range(steps):
        for out in core.step():
            assert isinstance(out, (Token, Finished)), out
            if isinstance(out, Token):
                got.setdefault(out.rid, []).append(out.token)
        if not core.has_work:
            return
    raise AssertionError(f"the engine still has work after {steps} steps")


def ids(batch: int, length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, V, (batch, length), generator=torch.Generator().manual_seed(seed))


def test_float32_logits_equal_transformers(case):
    folder, hf = case
    x = ids(2, 41)  # 41 tokens: several of Mamba's 8-step chunks and of the cache's 16-token blocks
    got = fastmamba.load(folder).forward(x)
    assert relative_error(got, transformers_logits(folder, x)) < 2e-3


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


def test_deterministic_mode_prefills_each_prompt_with_its_keys_and_values(case):
    """deterministic=True prefills each prompt of a batch alone (prefill.Prefill): each one's
    keys and values must come along into its slot, or its attention sees no prompt at all;
    a batch gives each prompt the tokens it gets alone, and the default mode's."""
    folder, _ = case
    lm, det = fastmamba.load(folder), fastmamba.load(folder, deterministic=True)
    prompts = [ids(1, n, seed=n)[0].tolist() for n in (5, 23, 9)]
    params = SamplingParams(max_tokens=10, stop_token_ids=[])
    want = [lm.generate(p, params).token_ids for p in prompts]
    assert [g.token_ids for g in det.generate_batch(prompts, params)] == want
    logits, state = det.prefill(prompts)
    assert [state.kv.held[k] for k in range(3)] == [5, 23, 9]


def assert_steps_continue_the_prefill(folder, length: int, prefix: int) -> None:
    """Teacher forcing: a prefill of `prefix` tokens then a step a token gives the logits of
    one pass over `length` tokens."""
    model = fastmamba.load(folder).model
    x = ids(2, length, seed=3)
    whole = model.forward(x)
    state = model.new_state(2)
    steps = [model.prefill(x[:, :prefix], state)[:, -1]]
    steps += [model.step(x[:, t], state) for t in range(prefix, length - 1)]
    assert relative_error(torch.stack(steps, 1), whole[:, prefix - 1 : length - 1]) < 1e-5


def test_decode_steps_continue_the_prefill(case):
    assert_steps_continue_the_prefill(case[0], 41, 30)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_16bit_storage_within_transformers_own_error(case, dtype):
    folder, _ = case
    x = ids(2, 33, seed=5)
    assert_within_transformers_16bit_error(fastmamba.load(folder, dtype=dtype).forward(x), folder, x, dtype)


@pytest.mark.parametrize("kv_tokens", [None, 512])
def test_the_prefix_cache_and_chunks_change_no_token(case, kv_tokens):
    """The serving engine with 8-token prefill chunks and the prefix cache (states and keys and
    values kept on a 16-token grid, at prompt ends and at a finished request's end), its KV
    cache growing or of fixed size (kv_tokens): each request's tokens are what generate gives
    it alone with the cache off; a prompt cached whole (the last) takes its first token from
    the cached logits."""
    folder, _ = case
    lm = fastmamba.load(folder)
    core = EngineCore(lm.model, lm.prefill, max_batch=3, prefill_tokens=8, prefix_cache_bytes=64 << 20,
                      kv_tokens=kv_tokens)
    core.cache.interval = 16
    base = ids(1, 37, seed=9)[0].tolist()
    prompts = [base, base + [5, 6, 7], base[:20], base + [8], base[:3], base]
    got = {}
    for rid, p in enumerate(prompts):
        core.add(Request(rid, p, SamplingParams(max_tokens=7, stop_token_ids=[])))
        run_until_done(core, got)  # one at a time: each later one can resume from the ones before
    assert core.cache_hits >= 4
    for rid, p in enumerate(prompts):
        assert got.get(rid) == lm.generate(p, max_tokens=7, stop_token_ids=[]).token_ids, rid


class PoolStepsOnTheCPU:
    """cuda_graphs.PoolDecodeGraphs' contract on the CPU: the step over the pool's first
    bucket rows, the KV cache's books left to the engine (kv_host=False: nothing reserved,
    the lengths advanced on the device alone), as a graph's replay runs it."""

    def __init__(self, model, pool, tokens, buckets=(2, 4)):
        self.model, self.pool, self.tokens, self.buckets = model, pool, tokens, buckets

    def bucket(self, d: int) -> int:
        return next(b for b in self.buckets if b >= d)

    def __call__(self, d: int):
        b = self.bucket(d)
        rows = MambaState(self.pool.conv[:, :b], self.pool.ssm[:, :b], self.pool.kv, kv_host=False)
        return self.model.step(self.tokens[:b], rows)


# (a variant over the one-row step, kernels/decode_step_hybrid.py, took 48 s of the CPU suite's
# 10 minutes: that step runs in the engine's graphs on the GPU in
# test_the_gpu_engine_runs_hybrids_as_the_cpu_does, and keeps the KV cache's books as the
# engine's graphs do in test_the_one_row_step_equals_the_reference_and_a_row_alone_...)
@pytest.mark.parametrize("ops", ["reference", "triton"])
def test_decode_steps_as_graphs_run_them_keep_each_context_in_its_own_blocks(tmp_path, ops):
    """The serving engine's decode as its CUDA graphs run it (on the CPU here; its steps over
    the reference ops, or the GPU's ops in Triton's interpreter: the decode attention's
    kernels): three requests at once, each decoding past its prompt's last block into blocks
    reserved at admission (block 0 is every table's filler: a store there would land in the
    others' context), with padding rows in a bucket of 4, the step ahead (a request's last
    token fed past its end) and the prefix cache on; each gets what generate gives it alone."""
    if ops != "reference" and torch.cuda.is_available():
        pytest.skip("the Triton kernels over CPU tensors: Triton's interpreter (the GPU's own: the gpu tests)")
    config, model_class = bamba()
    torch.manual_seed(0)
    model_class(config).save_pretrained(tmp_path)
    lm = fastmamba.load(tmp_path)
    core = EngineCore(lm.model, lm.prefill, max_batch=4, prefix_cache_bytes=64 << 20, kv_tokens=128)
    steps = lm.model
    if ops == "triton":
        pytest.importorskip("triton")
        from fastmamba.core.model import Mamba
        from fastmamba.core.ops import triton_ops
        from fastmamba.engine.plan import KERNEL_TILES

        steps = Mamba(lm.model.config, lm.model.weights, triton_ops(KERNEL_TILES))
    core.decode_graphs = PoolStepsOnTheCPU(steps, core.pool, core.tokens)
    core.run_ahead = True  # (as on the GPU: a step launched before the last one's tokens are read)
    prompts = [ids(1, n, seed=n)[0].tolist() for n in (14, 30, 9)]  # (+ 8 tokens: each into a new block)
    for rid, p in enumerate(prompts):
        core.add(Request(rid, p, SamplingParams(max_tokens=8, stop_token_ids=[])))
    got = {}
    run_until_done(core, got, steps=100)
    for rid, p in enumerate(prompts):
        assert got[rid] == lm.generate(p, max_tokens=8, stop_token_ids=[]).token_ids, rid


# -- configs refused by name ------------------------------------------------------------------


def edited(folder, tmp_path, change) -> str:
    """A copy of the checkpoint `folder` whose config.json `change(config)` edited."""
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


@pytest.mark.parametrize("change,words", [
    (lambda c: c.update(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10.0}), ("linear",)),
    (lambda c: c.update(num_key_value_heads=3), ("num_key_value_heads",)),
    (lambda c: c.update(sliding_window=8), ("sliding_window",)),
    (lambda c: c.update(num_attention_heads=8), ("self_attn.", "has shape")),  # a tensor of another shape, named
])
def test_bamba_configs_that_change_the_math_are_refused_by_name(tmp_path, change, words):
    config, model_class = bamba()
    folder = tmp_path / "m"
    model_class(config).save_pretrained(folder)
    refused(edited(folder, tmp_path, change), *words)


def legacy_rope(c):  # transformers 4's format: the base at the top level, no factor
    c.pop("rope_parameters")
    c["rope_theta"] = 500.0


@pytest.mark.parametrize("change", [legacy_rope, lambda c: c["rope_parameters"].pop("partial_rotary_factor")],
                         ids=["top-level rope_theta", "rope_parameters without a factor"])
def test_bamba_rotates_half_of_each_head_where_its_config_gives_no_factor(tmp_path, change):
    """transformers' BambaConfig takes partial_rotary_factor 0.5 where config.json says none."""
    config, model_class = bamba()
    model_class(config).save_pretrained(tmp_path / "m")
    folder = edited(tmp_path / "m", tmp_path, change)
    x = ids(1, 24)
    assert relative_error(fastmamba.load(folder).forward(x), transformers_logits(folder, x)) < 2e-3


def drop_attention_multiplier(c):
    c.pop("attention_multiplier")


def top_level_full_rope(c):  # transformers' BambaConfig puts 0.5 in place of it
    c.pop("rope_parameters")
    c.update(rope_theta=10000.0, partial_rotary_factor=1.0)


@pytest.mark.parametrize("make,change", [
    (lambda: granite(attention_multiplier=1.0,  # (a scale that lets the rotation show)
                     rope_parameters={"rope_type": "default", "rope_theta": 1000.0, "partial_rotary_factor": 0.5}),
     None),
    (lambda: falcon(rope_parameters={"rope_type": "default", "rope_theta": 300.0, "partial_rotary_factor": 0.5}), None),
    (granite, drop_attention_multiplier),
    (lambda: nemotron(use_bias=True), None),
    (bamba, top_level_full_rope),
], ids=["granite partial_rotary_factor", "falcon_h1 partial_rotary_factor", "granite without attention_multiplier",
        "nemotron_h use_bias beside mamba_proj_bias", "bamba top-level partial_rotary_factor"])
def test_config_keys_are_read_as_transformers_reads_them(tmp_path, make, change):
    """Keys transformers' models do not read (Granite's and Falcon-H1's RoPE turns whole heads;
    NemotronH's mamba_proj_bias, written beside use_bias; Bamba's top-level factor, overridden)
    and its defaults (Granite's attention_multiplier 1.0): logits as transformers' own."""
    config, model_class = make()
    torch.manual_seed(0)
    model_class(config).save_pretrained(tmp_path / "m")
    folder = edited(tmp_path / "m", tmp_path, change) if change else tmp_path / "m"
    x = ids(2, 24)
    assert relative_error(fastmamba.load(folder).forward(x), transformers_logits(folder, x)) < 2e-3


def test_a_scaled_rope_is_refused_beside_default_rope_parameters(tmp_path):
    """rope_scaling's type is read even where rope_parameters says "default" (transformers
    applies the scaling)."""
    config, model_class = bamba()
    model_class(config).save_pretrained(tmp_path / "m")
    refused(edited(tmp_path / "m", tmp_path, lambda c: c.update(rope_scaling={"rope_type": "linear", "factor": 4.0})),
            "'linear'", "rope_scaling")


def test_nemotron_h_reads_the_hub_pattern(tmp_path):
    """(and experts in the pattern over dense weights name the missing router: Nemotron-H with
    experts is tests/test_moe.py's)"""
    config, model_class = nemotron()
    folder = tmp_path / "m"
    model_class(config).save_pretrained(folder)

    def hub_form(c):  # the hub's spelling of the pattern and the Mamba keys
        del c["layers_block_type"]
        c["hybrid_override_pattern"] = "M*-M-"
        c["mamba_n_groups"] = c.pop("n_groups")
    assert fastmamba.load(edited(folder, tmp_path / "a", hub_form)).config.kinds == (
        "mamba2", "attention", "mlp", "mamba2", "mlp")
    refused(edited(folder, tmp_path / "b", lambda c: c.update(layers_block_type=["mamba", "moe", "attention",
                                                                                           "mlp", "mamba"])),
            "missing tensor", "mixer.gate.weight")
    refused(edited(folder, tmp_path / "c", lambda c: c.update(mamba_n_groups=4)), "'n_groups'",
            "'mamba_n_groups'", "disagree")


def test_granite_with_experts_over_dense_weights_names_the_missing_expert_tensor(tmp_path):
    """(Granite with experts: tests/test_moe.py.)"""
    config, model_class = granite()
    folder = tmp_path / "m"
    model_class(config).save_pretrained(folder)
    refused(edited(folder, tmp_path, lambda c: c.update(num_local_experts=4, intermediate_size=48)),
            "missing tensor", "block_sparse_moe.")


def test_a_fixed_kv_cache_admits_what_fits_and_refuses_what_never_can(tmp_path):
    """The serving engine's KV cache of 96 tokens (six 16-token blocks): a request holds its
    prompt's and max_tokens' blocks from admission to its end (its prompt's keys and values
    copied in keep them), so two of 40 tokens each run
    together, a third waits for one of them to end, and one of 120 tokens can never fit (an
    error that says so); each still gets what generate gives it alone."""
    config, model_class = nemotron()
    folder = tmp_path / "m"
    model_class(config).save_pretrained(folder)
    lm = fastmamba.load(folder)
    core = EngineCore(lm.model, lm.prefill, max_batch=4, kv_tokens=96)
    prompts = [ids(1, 30, seed=k)[0].tolist() for k in range(3)]
    for rid, p in enumerate(prompts):
        core.add(Request(rid, p, SamplingParams(max_tokens=10, stop_token_ids=[])))
    core.add(Request(9, ids(1, 100)[0].tolist(), SamplingParams(max_tokens=20)))
    got, failed, running = {}, [], []
    for _ in range(200):
        outs = core.step()
        running.append(core.running)
        # each running request keeps its whole context's blocks (a decode step in a CUDA graph
        # reserves none: its stores past them would land in block 0)
        kv = core.pool.kv
        for r in core.slots:
            if r is not None and not r.finished:
                assert len(kv.owned[r.slot]) == kv.blocks_for(len(r.ids) + r.params.max_tokens)
        for out in outs:
            if isinstance(out, Token):
                got.setdefault(out.rid, []).append(out.token)
            elif not isinstance(out, Finished):
                failed.append(out)
        if not core.has_work:
            break
    assert [f.rid for f in failed] == [9]
    assert failed[0].error.kind == "context_too_long" and "holds 96" in failed[0].error.message
    assert max(running) == 2  # the third waited for blocks
    for rid, p in enumerate(prompts):
        assert got[rid] == lm.generate(p, max_tokens=10, stop_token_ids=[]).token_ids


def test_a_gpu_kv_cache_takes_half_the_memory_left_once_the_slots_are_made(tmp_path, monkeypatch):
    """The KV cache a server or generate makes on a GPU (kv_cache_tokens with no size given):
    half of what is free less the slots' bytes, in tokens; a size given is taken as it is; a
    model without attention has none."""
    from types import SimpleNamespace

    from fastmamba.core.kv_cache import bytes_per_token
    from fastmamba.engine.memory import kv_cache_tokens, slot_bytes

    config, model_class = nemotron()
    model_class(config).save_pretrained(tmp_path / "m")
    model = fastmamba.load(tmp_path / "m").model
    per_token = bytes_per_token(model.config, model.weights.embedding.element_size())
    free = 3 << 30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, 8 << 30))
    on_gpu = SimpleNamespace(config=model.config, weights=model.weights, device=torch.device("cuda"),
                             state_dtype=model.state_dtype)
    assert kv_cache_tokens(on_gpu, None, 8) == (free - 8 * slot_bytes(model)) // 2 // per_token
    assert kv_cache_tokens(on_gpu, None, 8) < kv_cache_tokens(on_gpu, None, 1)
    assert kv_cache_tokens(on_gpu, 64, 8) == (64 << 20) // per_token
    assert kv_cache_tokens(model, None, 8) == (1024 << 20) // per_token  # the CPU's default
    mamba = fastmamba.load().model
    assert kv_cache_tokens(mamba, None, 8) is None


def warm_up_passes(lm, core: EngineCore) -> list[tuple[int, int, bool, bool]]:
    """warm_up_prefill(core), and the model's prefill passes in it: (rows, tokens, whether
    the rows' contexts held keys and values before, whether left-padded)."""
    passes, prefill, kv = [], lm.model.prefill, core.pool.kv

    def recorded(input_ids, state, start=None, last_only=False):
        held = state.kv is kv and any(kv.held[r] for r in state.cache_rows())
        passes.append((input_ids.shape[0], input_ids.shape[1], held, start is not None))
        return prefill(input_ids, state, start, last_only)

    lm.model.prefill = recorded
    try:
        warm_up_prefill(core)
    finally:
        del lm.model.prefill
    return passes


def test_the_prefill_warm_up_meets_each_kind_of_length_and_leaves_nothing_behind(tmp_path):
    """warm_up.warm_up_prefill (a GPU server's start, for a hybrid: its eager prefill's Triton
    kernels compile a variant for each kind of length): prompts of 1, 2, 3, 4, 8 and each
    power of two p and p + 1, 2, 4, 8 up to the cache's interval, alone, two at a time with
    left padding, and after a first chunk; then the powers of two up to the prefill budget
    (whole where the cache is off). Afterwards no slot, KV block, cached prefix or count is left, and a prompt decodes
    as on an engine never warmed."""
    config, model_class = nemotron()
    torch.manual_seed(0)
    model_class(config).save_pretrained(tmp_path)
    lm = fastmamba.load(tmp_path)

    def engine(cache_bytes=1 << 22):
        return EngineCore(lm.model, lm.prefill, max_batch=4, prefill_tokens=2048, prefix_cache_bytes=cache_bytes,
                          kv_tokens=4096)

    core = engine()
    kv = core.pool.kv
    free = sorted(kv.free)
    passes = warm_up_passes(lm, core)
    # each chunk tile (a power of two) with lengths odd and divisible by 2, 4, 8 and 16
    lengths = {1, 2, 3, 4, 8} | {p + d for p in (16, 32, 64, 128, 256) for d in (0, 1, 2, 4, 8)} | {512}
    alone = {t for b, t, held, _ in passes if b == 1 and not held}
    assert lengths <= alone, sorted(lengths - alone)
    assert any(b == 2 and padded for b, _, _, padded in passes)  # two prompts together, left-padded
    continued = {t for _, t, held, _ in passes if held}  # after a first chunk of 512
    assert lengths <= continued, sorted(lengths - continued)
    assert core.running == 0 and not core.waiting and not core.requests and not core.has_work
    assert sorted(kv.free) == free and not any(kv.owned) and not any(kv.held)
    assert core.cache.bytes == 0 and (core.cache_queries, core.cache_hits) == (0, 0)
    prompt = ids(1, 37, seed=5)[0].tolist()
    got = []
    for c in (core, engine()):
        c.add(Request(0, prompt, SamplingParams(max_tokens=6, stop_token_ids=[])))
        got.append({})
        run_until_done(c, got[-1])
    assert got[0] == got[1] and len(got[0][0]) == 6
    # without the prefix cache, prompts up to the budget prefill whole
    whole = {t for b, t, held, _ in warm_up_passes(lm, engine(0)) if b == 1 and not held}
    assert {513, 1024, 2048} <= whole, sorted(whole)
    # an engine whose prefill fails does not start quietly
    broken = engine()
    broken.prefill = None
    with pytest.raises(RuntimeError, match="warm-up's prompts of \\[1\\] tokens failed"):
        warm_up_prefill(broken)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["nemotron_h", "bamba", "granite_nope_tied", "falcon_h1"])
def test_the_gpu_engine_runs_hybrids_as_the_cpu_does(tmp_path, name):
    """The GPU engine (the Triton ops for the Mamba sublayers, torch's for attention and MLP):
    float32 logits within 1e-3 of the CPU's, greedy tokens and a batch equal to the CPU's
    alone; bf16 storage within 1.5x transformers' own bf16 error: the GPU engine rounds each
    product's input to bf16, as transformers does, where the CPU engine (held to 1.25x) keeps
    float32 (H100, 2026-12-06: Granite 1.29x, the others under 1.25x). (Granite without RoPE: whether a
    Granite hybrid with position_embedding_type 'rope' rotates differs between transformers'
    versions, 5.17 against 5.25 a float32 error of 0.014; published Granite-4.0-H models are
    NoPE. RoPE is covered here by Bamba's partial and Falcon-H1's full rotation.)"""
    config, model_class = CASES[name]()
    torch.manual_seed(0)
    model_class(config).save_pretrained(tmp_path)
    assert_the_gpu_engine_runs_it_as_the_cpu_does(tmp_path)


def assert_the_gpu_engine_runs_it_as_the_cpu_does(folder):
    """The checkpoint in `folder` loads on the GPU engine by default; its float32 logits within
    1e-3 of the CPU's, its greedy tokens and a batch's equal to the CPU's alone, bf16 storage
    within 1.5x transformers' own bf16 error (see the test above)."""
    cpu, gpu = fastmamba.load(folder), fastmamba.load(folder, device="cuda")
    assert gpu.engine == "triton"
    x = ids(2, 41)
    assert relative_error(gpu.forward(x.cuda()), cpu.forward(x)) < 1e-3
    prompts = [ids(1, n, seed=n)[0].tolist() for n in (5, 23, 9)]
    want = [cpu.generate(p, max_tokens=10, stop_token_ids=[]).token_ids for p in prompts]
    assert [g.token_ids for g in gpu.generate_batch(prompts, SamplingParams(max_tokens=10, stop_token_ids=[]))] == want
    bf16 = fastmamba.load(folder, device="cuda", dtype="bfloat16")
    assert_within_transformers_16bit_error(bf16.forward(x.cuda()), folder, x, "bfloat16", bound=1.5)
    # a server's chunks: the GPU's eager prefill on the prefix cache's coarser grid, the CPU's on the finer
    from fastmamba.engine.prefix_cache import EAGER_INTERVAL, INTERVAL
    assert [EngineCore(lm.model, lm.prefill, max_batch=2).cache.interval for lm in (gpu, cpu)] == [EAGER_INTERVAL, INTERVAL]


# the paged kernels' tests: 3 rows, 6 query and 2 key-value heads of 12, blocks of 4 tokens in a
# pool of 20, each of 5 slots' tables 7 blocks wide
PAGED = (3, 6, 2, 12, 4, 20, 7)


def paged_cache(g: torch.Generator, dtype=torch.float32):
    """Random keys and values (blocks, BS, KVH, hd) in `dtype` and 5 slots' tables of scattered
    blocks, none of them block 0."""
    _, _, KVH, hd, BS, NB, W = PAGED
    k, v = (torch.randn(NB, BS, KVH, hd, generator=g).to(dtype) for _ in range(2))
    return k, v, torch.stack([torch.randperm(NB - 1, generator=g)[:W] + 1 for _ in range(5)])


@pytest.mark.parametrize("splits, tokens", [(1, 16), (3, 64), (8, 16)])
def test_the_paged_decode_kernel_equals_its_twin(splits, tokens):
    """kernels/paged_attention.py (compiled where CUDA is, else Triton's interpreter): scattered
    blocks, GQA, rows that index other slots, lengths that end mid-block and at one token,
    splits with no block, a program's runs of several blocks one after another (runs of 16
    tokens: 4 blocks)."""
    pytest.importorskip("triton")
    from fastmamba.kernels.paged_attention import PagedTiles, paged_decode, paged_decode_ref

    g = torch.Generator().manual_seed(splits)
    B, H, _, hd = PAGED[:4]
    k, v, table = paged_cache(g)
    lengths, rows = torch.tensor([0, 9, 27, 3, 5]), torch.tensor([1, 0, 2])
    q = torch.randn(B, H, hd, generator=g)
    on = [t.to(KERNELS_ON) for t in (q, k, v, table, lengths, rows)]
    got = paged_decode(*on[:5], 0.3, on[5], 1, tiles=PagedTiles(splits * PAGED[2], 1, tokens)).cpu()
    want = paged_decode_ref(q, k, v, table, lengths, 0.3, rows, 1)
    assert (got - want).abs().max() < 1e-5
    broken = paged_decode_ref(q, k, v, table, lengths, 0.3, rows, 0)  # (one token fewer: the test can fail)
    assert (got - broken)[[0, 2]].abs().max() > 1e-3  # (row 1's slot would hold no token)


@pytest.mark.parametrize("theta, rotary_dim", [(0.0, 0), (500.0, 6), (10000.0, 12)])
def test_the_decode_attention_kernels_equal_their_twin(theta, rotary_dim):
    """kernels/paged_attention.decode_attention (compiled where CUDA is, else Triton's
    interpreter): a row's new query and key rotated at its slot's length (none, part of a head,
    all of it), the key and value stored in that slot's block (16-bit there), the attention
    over the slot's tokens and the new one; rows that index other slots, a position at a
    block's start and mid-block."""
    pytest.importorskip("triton")
    from fastmamba.kernels.paged_attention import PagedTiles, decode_attention, decode_attention_ref

    g = torch.Generator().manual_seed(rotary_dim)
    B, H, KVH, hd = PAGED[:4]
    k, v, table = paged_cache(g, torch.bfloat16)
    lengths, rows = torch.tensor([0, 9, 27, 3, 4]), torch.tensor([4, 0, 2])
    qkv = 3 * torch.randn(B, (H + 2 * KVH) * hd, generator=g)
    ours, theirs = [t.clone().to(KERNELS_ON) for t in (k, v)], [k.clone(), v.clone()]  # (the caches each stores in)
    on = [t.to(KERNELS_ON) for t in (qkv, table, lengths, rows)]
    got = decode_attention(on[0], *ours, *on[1:], H, 0.3, theta, rotary_dim, tiles=PagedTiles(3 * KVH, 1, 64)).cpu()
    ours = [t.cpu() for t in ours]
    want = decode_attention_ref(qkv, *theirs, table, lengths, rows, H, 0.3, theta, rotary_dim)
    # (bf16 keys and values: both round the products' other operands to bf16, the kernel its
    # weights before the splits are added, the twin after: apart by ~1e-3 of the largest)
    assert (got - want).abs().max() < 3e-3 * want.abs().max()
    assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1])
    assert not torch.equal(ours[0], k)  # (the keys were stored: the test can fail)
    if theta:  # the rotation is there to be checked: without it the outputs move
        plain = decode_attention_ref(qkv, k.clone(), v.clone(), table, lengths, rows, H, 0.3)
        assert (got - plain)[[0, 2]].abs().max() > 1e-3  # (row 1's slot is at position 0: no turn)


@pytest.mark.parametrize("act, gated", [("silu", True), ("relu2", False), ("relu2", True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_mlp_activation_kernel_equals_its_twin(act, gated, dtype):
    """kernels/mlp_activation.py (Triton's interpreter here): the activation (of the gate,
    times up), over rows of a width that is not a power of two, rounded once to `dtype`."""
    pytest.importorskip("triton")
    from fastmamba.kernels.mlp_activation import mlp_activation, mlp_activation_ref

    a = 3 * torch.randn(2, 3, 2 * 1100 if gated else 1100, generator=torch.Generator().manual_seed(1))
    got = mlp_activation(a, act, gated, dtype)
    want = mlp_activation_ref(a, act, gated)
    assert got.shape == want.shape == (2, 3, 1100) and got.dtype == dtype
    assert torch.allclose(got.float(), want.to(dtype).float(), rtol=2e-6 if dtype == torch.float32 else 8e-3, atol=1e-6)
    other = mlp_activation_ref(a, "silu" if act == "relu2" else "relu2", gated)  # (the test can fail)
    assert not torch.allclose(got.float(), other, rtol=1e-2, atol=1e-2)


# (a subset of CASES, for the CPU suite's time: a squared-ReLU MLP without a gate; a gated one
# with partial RoPE; NoPE with Granite's multipliers and a tied head; Falcon-H1's parallel
# layer without its SSM norm)
@pytest.mark.parametrize("name", ["nemotron_h", "bamba", "granite_nope_tied", "falcon_h1"])
def test_the_one_row_step_equals_the_reference_and_a_row_alone_its_bits_in_a_batch(tmp_path, name):
    """kernels/decode_step_hybrid.py's step (Triton's interpreter here) after a prefill of 18
    tokens (past a KV block), as the engine's graphs run it (blocks reserved by the engine,
    the lengths advanced on the device): each family's logits and Mamba states against the
    reference's steps (tests/test_moe.py does the same with experts), and a row alone the
    same bits as in a batch of two. (On a GPU where there is one: not `gpu`-marked, it runs
    the kernels themselves there, PDL included.)"""
    save_case(name, tmp_path)
    assert_the_one_row_step_equals_the_reference(tmp_path)


def test_two_products_of_one_row_in_one_launch_equal_two_launches(tmp_path):
    """DecodeStep._rmsnorm_linear's `also` (Falcon-H1's in_proj and q/k/v, one launch): each
    output the bits of its own launch; with a bias on one of them only, two launches again,
    the same bits."""
    pytest.importorskip("triton")
    from fastmamba.core.model import Mamba
    from fastmamba.core.ops import triton_ops
    from fastmamba.engine.decode_step import make_decode_step
    from fastmamba.engine.plan import KERNEL_TILES, DecodePlan

    save_case("falcon_h1", tmp_path)
    device = KERNELS_ON
    model = fastmamba.load(tmp_path, device=device).model
    step = make_decode_step(Mamba(model.config, model.weights, triton_ops(KERNEL_TILES)), 2, plan=DecodePlan("one-row"))
    g = torch.Generator().manual_seed(3)
    step.h.copy_(torch.randn(step.h.shape, generator=g))
    lw = model.weights.layers[0]
    m, at = lw.mamba, lw.attention
    blocks, qkv = step.in_proj_blocks, []
    for bias in (None, torch.randn(at.qkv_w.shape[0], generator=g).to(device)):
        alone = []
        for w, b, out in ((m.in_proj_w, m.in_proj_b, step.zxbcdt), (at.qkv_w, bias, step.qkv)):
            step._rmsnorm_linear(lw.norm_w, w, b, out, blocks)
            alone.append(out.clone())
        step.zxbcdt.zero_(), step.qkv.zero_()
        step._rmsnorm_linear(lw.norm_w, m.in_proj_w, m.in_proj_b, step.zxbcdt, blocks, also=(at.qkv_w, bias, step.qkv))
        assert torch.equal(step.zxbcdt, alone[0]) and torch.equal(step.qkv, alone[1])
        qkv.append(alone[1])
    assert not torch.allclose(qkv[0], qkv[1])  # (the bias was read)


def test_the_one_row_step_reads_fp8_weights(tmp_path):
    """The same with FP8 weights (e4m3, a scale a row): the kernels' sums of the e4m3 values
    against the reference's (core/fp8.linear). The KV cache is bfloat16 under FP8 weights, and
    on a GPU the decode attention's tensor-core products round their operands to it (DESIGN
    §4) where the reference's keep the softmax's weights float32: 2.3e-3 on an H100."""
    config, model_class = nemotron()
    torch.manual_seed(0)
    model_class(config).save_pretrained(tmp_path)
    assert_the_one_row_step_equals_the_reference(tmp_path, "fp8", tol=5e-3)


def assert_the_one_row_step_equals_the_reference(folder, dtype: str = "float32", tol: float = 1e-4) -> None:
    """The tests above: the reference's prefill of 18 tokens, its states copied to the one-row
    step's, then 2 steps of each."""
    pytest.importorskip("triton")
    from fastmamba.core.model import Mamba
    from fastmamba.core.ops import triton_ops
    from fastmamba.engine.decode_step import make_decode_step
    from fastmamba.engine.plan import KERNEL_TILES, DecodePlan

    device = KERNELS_ON
    ref = fastmamba.load(folder, dtype=dtype).model
    ours = Mamba(ref.config, fastmamba.load(folder, device=device, dtype=dtype).model.weights, triton_ops(KERNEL_TILES))
    x = ids(2, 20, seed=5)
    s_ref = ref.new_state(2, 32)
    ref.prefill(x[:, :18], s_ref)

    def copy_of(rows: list[int]) -> MambaState:
        state = ours.new_state(len(rows), 32)
        state.conv.copy_(s_ref.conv[:, rows]), state.ssm.copy_(s_ref.ssm[:, rows])
        for to, r in enumerate(rows):
            state.kv.copy_slot(to, s_ref.kv, r)
        return state

    def steps(state, rows: list[int]) -> list[torch.Tensor]:
        step, kv, out = make_decode_step(ours, len(rows), plan=DecodePlan("one-row")), state.kv, []
        assert type(step).__name__ == "HybridDecodeStep"
        for t in range(18, 20):
            for r in range(len(rows)):  # (the engine's books: blocks reserved before, host lengths after)
                kv.reserve(r, kv.held[r] + 1)
            view = MambaState(state.conv, state.ssm, kv, kv_host=False)
            out.append(step(x[rows, t].to(device), view).cpu().clone())
            kv.after_graph_step(len(rows), len(rows))
        return out

    s_ours, alone = copy_of([0, 1]), copy_of([1])
    got = steps(s_ours, [0, 1])
    for t, (a, b) in enumerate(zip(got, [ref.step(x[:, t], s_ref) for t in range(18, 20)])):
        assert relative_error(a, b) < tol, t
    assert relative_error(s_ours.ssm.cpu(), s_ref.ssm) < tol and relative_error(s_ours.conv.cpu(), s_ref.conv) < tol
    assert all(torch.equal(a[0], b[1]) for a, b in zip(steps(alone, [1]), got))


def test_the_gpu_ops_decode_a_hybrid_as_the_reference_does(tmp_path):
    """The GPU engine's ops (the Mamba kernels, the paged decode attention; Triton's interpreter
    without CUDA) over a prefill and steps: the reference's logits."""
    pytest.importorskip("triton")
    config, model_class = bamba()
    torch.manual_seed(0)
    model_class(config).save_pretrained(tmp_path)
    assert_the_gpu_ops_decode_it_as_the_reference_does(tmp_path)


def assert_the_gpu_ops_decode_it_as_the_reference_does(folder):
    """The checkpoint's model over the GPU ops (compiled where CUDA is, else Triton's
    interpreter): the CPU reference's logits over a prefill of 20 tokens and 5 steps."""
    from fastmamba.core.model import Mamba
    from fastmamba.core.ops import triton_ops
    from fastmamba.engine.plan import KERNEL_TILES

    device = KERNELS_ON
    ref = fastmamba.load(folder).model
    on_device = fastmamba.load(folder, device=device).model
    ours = Mamba(on_device.config, on_device.weights, triton_ops(KERNEL_TILES))
    x = ids(2, 25, seed=4)
    states = ref.new_state(2), ours.new_state(2)
    ref.prefill(x[:, :20], states[0])
    ours.prefill(x[:, :20].to(device), states[1])
    for t in range(20, 25):
        want, got = ref.step(x[:, t], states[0]), ours.step(x[:, t].to(device), states[1]).cpu()
        assert relative_error(got, want) < 1e-4, t


def test_config_keys_of_the_wrong_json_type_are_named(tmp_path):
    """A list or an object where a name or a number belongs is one error naming the key (they
    were a bare TypeError: unhashable type, or a product of a dict and an int)."""
    config, model_class = nemotron()
    model_class(config).save_pretrained(tmp_path / "n")
    refused(edited(tmp_path / "n", tmp_path / "a", lambda c: c.update(
        layers_block_type=[["mamba"], "attention", "mlp", "mamba", "mlp"])), "'layers_block_type'")
    config, model_class = granite()
    model_class(config).save_pretrained(tmp_path / "g")
    refused(edited(tmp_path / "g", tmp_path / "b", lambda c: c.update(layer_types=["mamba", {}, "mamba"])),
            "'layer_types'")
    for k, head in enumerate(({"value": 16}, "16", [16], 16.0, True)):
        refused(edited(tmp_path / "g", tmp_path / f"c{k}", lambda c: c.update(mamba_d_head=head)),
                "'mamba_d_head'", "positive integer")


def test_a_multiplier_whose_product_overflows_is_named(tmp_path):
    """Each factor within float32, their product past it: the model loaded and its first
    forward named a layer's NaN, not the config's multiplier."""
    config, model_class = granite()
    model_class(config).save_pretrained(tmp_path / "m")
    edited_config = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps({**edited_config, "residual_multiplier": 1e37}))
    from safetensors.torch import load_file, save_file
    weights = tmp_path / "m" / "model.safetensors"
    tensors = load_file(str(weights))
    for name, t in tensors.items():
        if name.endswith("out_proj.weight"):
            t[0, 0] = 1e3
    save_file(tensors, str(weights), metadata={"format": "pt"})
    refused(tmp_path / "m", "multiplier 1e+37", "out_proj.weight", "overflows float32")
