"""The engine core (engine/engine_core.py) without HTTP: what `generate` and `serve` both run,
its requests and outputs protocol.py's messages."""

from __future__ import annotations

import pytest
import torch

import fastmamba
from fastmamba.core.sampling_params import SamplingParams
from fastmamba.engine.engine_core import EngineCore
from fastmamba.engine.protocol import Finished, Request, Token
from fastmamba.engine.warm_up import warm_up_samplers

_rids = iter(range(1 << 30))


def engine(lm, **options) -> EngineCore:
    """The engine core over a language model's model and prefill."""
    return EngineCore(lm.model, lm.prefill, threads=lm.threads, **options)


def request(ids, params, top_logprobs=None) -> Request:
    return Request(next(_rids), ids, params, top_logprobs)


@pytest.fixture(scope="module")
def lm():
    return fastmamba.load()


def run(core: EngineCore, reqs: list[Request], limit: int = 10_000) -> dict:
    """Steps until every request ended: {rid: (tokens, finish reason, its Finished)}."""
    for r in reqs:
        core.add(r)
    got = {r.rid: ([], None, None) for r in reqs}
    for _ in range(limit):
        for out in core.step():
            tokens, _, _ = got[out.rid]
            if isinstance(out, Token):
                tokens.append(out.token)
            else:
                assert isinstance(out, Finished), out
                got[out.rid] = (tokens, out.reason, out)
        if all(v[1] is not None for v in got.values()) and not core.has_work:
            return got
    raise AssertionError("the engine did not finish")


def jobs(lm, n: int) -> list[Request]:
    prompts = ["To be, or not to be", "ROMEO.", "a", "Now is the winter of our discontent " * 3]
    return [request(lm.encode(prompts[k % 4]), SamplingParams(max_tokens=5 + 3 * k, temperature=0.8 * (k % 2),
                                                                    seed=k, stop_token_ids=[] if k % 3 else None))
            for k in range(n)]


@pytest.mark.parametrize("run_ahead", [False, True])
@pytest.mark.parametrize("prefill_tokens", [8, 4096])
def test_each_request_gets_what_generate_gives_it_alone(lm, run_ahead, prefill_tokens):
    """More requests than slots, prompts prefilled in chunks or together, and (run_ahead)
    the GPU's bookkeeping of a step ahead, whose extra steps past an end are discarded."""
    core = engine(lm, max_batch=3, prefill_tokens=prefill_tokens)
    core.run_ahead = run_ahead
    reqs = jobs(lm, 8)
    got = run(core, reqs)
    for r in reqs:
        want = lm.generate(r.ids, r.params)
        tokens, reason, info = got[r.rid]
        assert tokens == want.token_ids and reason == want.finish_reason, r.rid
        assert info.completion_tokens == len(tokens) and info.prompt_tokens == len(r.ids)
    assert core.running == 0 and not core.requests


@pytest.mark.parametrize("run_ahead", [False, True])
def test_a_finished_requests_state_is_cached_at_prompt_plus_output(lm, run_ahead):
    """The state kept when a request ends is the state after every token it fed: a prompt
    that continues the conversation resumes there and gets the cold prefill's tokens."""
    core = engine(lm, max_batch=2, prefill_tokens=64, prefix_cache_bytes=64 << 20)
    core.run_ahead = run_ahead
    first = request(lm.encode("ROMEO.\nWhat say you?"), SamplingParams(max_tokens=12, stop_token_ids=[]))
    tokens = run(core, [first])[first.rid][0]
    follow = first.ids + tokens + lm.encode(" Speak again.")
    second = request(follow, SamplingParams(max_tokens=6))
    got, _, info = run(core, [second])[second.rid]
    # the step ahead has fed the last token too; without it, the one before
    assert info.cached_tokens == len(first.ids) + len(tokens) - (0 if run_ahead else 1)
    assert got == lm.generate(follow, max_tokens=6).token_ids


@pytest.mark.parametrize("run_ahead", [False, True])
def test_a_prompt_cached_whole_takes_its_first_token_from_the_cached_logits(lm, run_ahead):
    """The same prompt twice: the second finds its whole prompt in the prefix cache, prefills
    nothing and still gets every token the first got."""
    core = engine(lm, max_batch=2, prefill_tokens=64, prefix_cache_bytes=64 << 20)
    core.run_ahead = run_ahead
    prompt = lm.encode("To be, or not to be")
    params = SamplingParams(max_tokens=6, stop_token_ids=[])
    first = run(core, [request(prompt, params)], limit=200)
    second = request(prompt, params)
    tokens, reason, info = run(core, [second], limit=200)[second.rid]
    assert info.cached_tokens == len(prompt)
    assert tokens == next(iter(first.values()))[0] == lm.generate(prompt, params).token_ids


def test_abort_frees_the_slot_and_ends_the_outputs(lm):
    core = engine(lm, max_batch=1, prefill_tokens=64)
    long = core.add(request(lm.encode("To be"), SamplingParams(max_tokens=1000, stop_token_ids=[])))
    waiting = core.add(request(lm.encode("To be"), SamplingParams(max_tokens=2)))
    for _ in range(3):
        core.step()
    assert core.running == 1 and len(core.waiting) == 1
    core.abort(long.rid)
    outs = []
    while core.has_work:
        outs += core.step()
    assert {o.rid for o in outs} == {waiting.rid} and isinstance(outs[-1], Finished)


def test_logprobs_are_the_chosen_and_best_tokens(lm):
    core = engine(lm, max_batch=2)
    core.add(request(lm.encode("To be"), SamplingParams(max_tokens=3), top_logprobs=2))
    entries = []
    while core.has_work:
        entries += [(o.logprob.chosen, o.logprob.top) for o in core.step() if isinstance(o, Token)]
    logits = lm.forward(torch.tensor([lm.encode("To be")]))[0, -1]
    best = torch.log_softmax(logits, -1).topk(2)
    chosen, top = entries[0]
    assert chosen == pytest.approx(best.values[0].item(), abs=1e-5) and top[0][0] == best.indices[0].item()
    assert len(entries) == 3 and all(len(e[1]) == 2 for e in entries)


@pytest.mark.gpu
def test_the_engine_on_the_gpu_generates_what_generate_does_alone(text_checkpoint):
    """Deterministic mode (a slot's logits bitwise the same at any batch size), chunked
    prefill (a budget of 64 tokens a step) and the step ahead, against generate alone."""
    lm = fastmamba.load(text_checkpoint, device="cuda", deterministic=True)
    core = engine(lm, max_batch=6, prefill_tokens=64)
    reqs = [request(lm.encode("To be, or not to be " * (1 + k % 4)),
                    SamplingParams(max_tokens=8 + 3 * k, temperature=0.8, seed=k, stop_token_ids=[]))
            for k in range(10)]
    got = run(core, reqs)
    for r in reqs:
        assert got[r.rid][0] == lm.generate(r.ids, r.params).token_ids, r.rid


@pytest.mark.gpu
def test_chunk_prefill_graphs_continue_a_slot_as_the_eager_prefill_does(text_checkpoint):
    """The engine's prefill graphs (binary pieces, two slots' states gathered from a pool
    and scattered back) against the model's own prefill over the same chunks, from the
    same non-zero states; the pool's other slots untouched."""
    from fastmamba.engine.cuda_graphs import ChunkPrefillGraphs

    lm = fastmamba.load(text_checkpoint, device="cuda")
    model = lm.model
    graphs = ChunkPrefillGraphs(model, 64, batch=2)
    ids = torch.randint(1, model.config.vocab_size, (2, 40 + 77), device="cuda")
    with torch.inference_mode():
        eager, pool = model.new_state(2), model.new_state(5)
        model.prefill(ids[:, :40], eager)
        rows = torch.tensor([3, 1], device="cuda")
        pool.conv[:, rows], pool.ssm[:, rows] = eager.conv, eager.ssm
        others = pool.ssm[:, [0, 2, 4]].clone()
        want = model.prefill(ids[:, 40:], eager, last_only=True)
        got = graphs(ids[:, 40:], pool, rows).clone()  # 77 = 64 + 8 + 4 + 1
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(pool.ssm[:, rows], eager.ssm, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(pool.conv[:, rows], eager.conv, rtol=1e-4, atol=1e-4)
    assert torch.equal(pool.ssm[:, [0, 2, 4]], others)


def test_the_cyclic_gc_is_off_inside_a_graph_capture(monkeypatch):
    """capture_graph runs the captured call with Python's cyclic GC off (a collection there
    may destroy a dead engine's graph mid-capture), the warm-ups with it on, and leaves it
    as it found it, also when the body raises. torch.cuda's stream and graph calls are
    stood in for: no GPU here."""
    import contextlib
    import gc
    from types import SimpleNamespace

    from fastmamba.engine import cuda_graphs

    stream = SimpleNamespace(wait_stream=lambda other: None)
    monkeypatch.setattr(torch.cuda, "Stream", lambda: stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", object)
    monkeypatch.setattr(torch.cuda, "graph", lambda g, pool=None: contextlib.nullcontext())
    seen = []
    graph, out = cuda_graphs.capture_graph(lambda: seen.append(gc.isenabled()) or len(seen))
    assert seen == [True, True, False] and out == 3 and gc.isenabled()

    def fails():
        seen.append(gc.isenabled())
        if len(seen) > 5:
            raise RuntimeError("capture failed")
    with pytest.raises(RuntimeError):
        cuda_graphs.capture_graph(fails)
    assert gc.isenabled()
    gc.disable()
    try:
        with cuda_graphs.no_cyclic_gc():
            pass
        assert not gc.isenabled()  # it was off before: it stays off
    finally:
        gc.enable()


def test_the_prefix_cache_holds_sixteen_states_of_a_large_model_by_default():
    """--prefix-cache-mb's default: 256 MiB where states are small (the 130m shape's 4.6 MiB),
    room for 16 where they are not (the 2.8b shape's 25 MiB, Nemotron-H-8B's 100 MiB in float32,
    half in bf16), so that a shared prefix outlives the states a long prompt leaves on its way."""
    from types import SimpleNamespace

    from fastmamba.bench import HYBRID_SHAPES, SHAPES
    from fastmamba.core.config import MambaConfig
    from fastmamba.core.layers import state_bytes
    from fastmamba.engine.memory import PREFIX_CACHE_ENTRIES, default_prefix_cache_bytes

    small = SimpleNamespace(config=SHAPES["130m"], state_dtype=torch.float32)
    assert default_prefix_cache_bytes(small) == 256 << 20
    hybrid = MambaConfig.from_dict(HYBRID_SHAPES["nemotron-h-8b"], "nemotron-h-8b")
    for config, dtype in [(SHAPES["2.8b"], torch.float32), (hybrid, torch.float32), (hybrid, torch.bfloat16)]:
        got = default_prefix_cache_bytes(SimpleNamespace(config=config, state_dtype=dtype))
        assert got == PREFIX_CACHE_ENTRIES * (state_bytes(config, dtype.itemsize) + 4 * config.vocab_size) > 256 << 20


def test_the_sampler_warm_up_calls_each_gpu_sampler_and_leaves_the_slots_alone(lm, monkeypatch):
    """warm_up.warm_up_samplers (a GPU server's start): each kind of Triton sampler (in
    Triton's interpreter without CUDA) draws once with and once without a bitmask, penalties
    among them, on a scratch slot: the engine's own slots and counters are as before."""
    from fastmamba.kernels import sampler

    core = engine(fastmamba.load(device="cuda") if torch.cuda.is_available() else lm, max_batch=2)
    core.gpu = True  # (the GPU engine's samplers, pick_sampler's Triton ones: on the CPU in the interpreter)
    calls = []
    for name in ("sample_temperature", "sample_filtered_apart", "sample_filtered"):
        def spy(logits, p, tiles, penalties=False, bitmask=None, _name=name, _real=getattr(sampler, name)):
            calls.append((_name, penalties, bitmask is not None))
            tok = _real(logits, p, tiles, penalties, bitmask)
            assert 0 <= int(tok) < logits.shape[1]
            return tok
        monkeypatch.setattr(sampler, name, spy)
    before = {k: v.clone() for k, v in vars(core.slot_params).items()}
    warm_up_samplers(core)
    assert sorted(set(calls)) == sorted({(n, p, m) for n, p in [("sample_temperature", False), ("sample_temperature", True),
                                                                   ("sample_filtered_apart", False), ("sample_filtered", False)]
                                         for m in (False, True)})
    assert all(torch.equal(v, before[k]) for k, v in vars(core.slot_params).items())
    assert not core.has_work and not core.requests
