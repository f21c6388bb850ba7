"""OpenAI's logit_bias, presence_penalty and frequency_penalty: the formulas, the samplers
that apply them (the reference and the Triton ones, which must agree), a slot's counts
(its own output only, reset for each request), batch invariance, the engine and the server."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from conftest import save_hf_checkpoint

import fastmamba
from fastmamba.core.sampling import SlotParams, count_tokens, penalize, pick_sampler, sample, sample_penalized
from fastmamba.core.sampling_params import SamplingParams
from fastmamba.engine.engine_core import EngineCore
from fastmamba.engine.plan import SAMPLER_TILES
from fastmamba.engine.protocol import Finished, Request, Token

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
LOGITS = torch.tensor([1.0, 3.0, 2.5, -1.0, 0.5, 2.9, -4.0, 0.0])


def slots_for(params: list[SamplingParams], vocab: int, seeds=None, prompts=None, device="cpu") -> SlotParams:
    slots = SlotParams.empty(len(params), vocab, device)
    slots.set_slots([(p, seeds[i] if seeds else i, prompts[i] if prompts else []) for i, p in enumerate(params)])
    return slots


# -- the formulas -----------------------------------------------------------------------------


def test_penalize_is_openais_formula():
    """logits[j] + bias[j] - presence * (count[j] > 0) - frequency * count[j], by hand: token 2
    came three times, token 5 once."""
    p = SamplingParams(logit_bias={1: 2.0, 3: -1.5}, presence_penalty=0.5, frequency_penalty=0.25)
    slots = slots_for([p], 8, prompts=[[0, 4]])  # the prompt's tokens count for nothing
    for t in (2, 5, 2, 2):
        count_tokens(torch.tensor([t]), slots)
    assert slots.counts[0].tolist() == [0, 0, 3, 0, 0, 1, 0, 0]
    want = [1.0, 3.0 + 2.0, 2.5 - 0.5 - 0.25 * 3, -1.0 - 1.5, 0.5, 2.9 - 0.5 - 0.25, -4.0, 0.0]
    assert penalize(LOGITS[None], slots)[0].tolist() == pytest.approx(want, abs=1e-6)


@pytest.mark.parametrize("params, tokens", [
    # 3.0 2.8 2.0: each repeat costs 0.5 (a tie goes to the lower id)
    (SamplingParams(frequency_penalty=0.5), [0, 1, 0, 1, 0, 2, 1, 0]),
    # only the first use costs: once 0 and 1 are used, 0 (2.0) ties 2 (2.0) and wins ever after
    (SamplingParams(presence_penalty=1.0), [0, 1, 0, 0, 0, 0, 0, 0]),
    # a negative frequency penalty: each repeat makes a used token likelier (0 at 2.75, 3.0, 3.25 ...)
    (SamplingParams(presence_penalty=0.5, frequency_penalty=-0.25), [0, 1, 0, 0, 0, 0, 0, 0]),
])
def test_greedy_tokens_follow_the_penalties_by_hand(params, tokens):
    logits = torch.tensor([[3.0, 2.8, 2.0, 0.0]])
    slots = slots_for([params], 4, prompts=[[0, 1]])  # the prompt's 0 and 1: no penalty on them
    got = [sample_penalized(logits.clone(), slots).item() for _ in tokens]
    assert got == tokens
    assert slots.counts[0].tolist() == [tokens.count(j) for j in range(4)]
    assert slots.step.item() == len(tokens) and slots.seen[0, tokens].all()


def test_a_bias_of_minus_100_bans_and_100_forces_a_token():
    n = 2000  # n slots, n seeds
    for temperature in (0.0, 1.0):
        banned = sample_penalized(LOGITS.expand(n, -1).clone(), slots_for(
            [SamplingParams(temperature=temperature, logit_bias={1: -100, 5: -100})] * n, 8, seeds=list(range(n))))
        assert not ({1, 5} & set(banned.tolist()))
        forced = sample_penalized(LOGITS.expand(n, -1).clone(), slots_for(
            [SamplingParams(temperature=temperature, logit_bias={6: 100})] * n, 8, seeds=list(range(n))))
        assert set(forced.tolist()) == {6}
    plain = sample(LOGITS.expand(n, -1).clone(), slots_for([SamplingParams(temperature=1.0)] * n, 8, seeds=list(range(n))))
    assert {1, 5} <= set(plain.tolist()) and plain.tolist().count(6) < 10  # (the bias, not the seeds, did it)


def test_the_penalties_come_before_the_repetition_penalty():
    """vLLM's order: bias and penalties on the raw logits, then the rest as before. Token 0
    (seen in the prompt, biased +1): (-0.2 + 1) / 3 = 0.27 < 0.3 picks token 1; the other
    order, -0.2 * 3 + 1 = 0.4, would pick token 0."""
    p = SamplingParams(repetition_penalty=3.0, logit_bias={0: 1.0})
    assert sample_penalized(torch.tensor([[-0.2, 0.3]]), slots_for([p], 2, prompts=[[0]])).item() == 1
    p = SamplingParams(repetition_penalty=3.0, presence_penalty=-1.0)  # the same through a count of 1
    slots = slots_for([p], 2, prompts=[[0]])
    count_tokens(torch.tensor([0]), slots)
    assert sample_penalized(torch.tensor([[-0.2, 0.3]]), slots).item() == 1


# -- batches and slots ------------------------------------------------------------------------

MIXED = [  # some rows use the new fields, some not
    SamplingParams(),
    SamplingParams(temperature=0.9, frequency_penalty=1.5, presence_penalty=0.5),
    SamplingParams(temperature=1.2, top_p=0.9),
    SamplingParams(logit_bias={3: 2.5, 17: -100}, presence_penalty=-0.5),
    SamplingParams(temperature=0.8, top_k=5, min_p=0.05, repetition_penalty=1.2, frequency_penalty=2.0,
                   logit_bias={0: 1.0}),
    SamplingParams(temperature=0.7, top_k=4, top_p=0.8, frequency_penalty=0.7),
]


def test_a_slot_samples_the_same_alone_or_beside_others():
    """A mixed batch through sample_penalized, step after step, against each slot alone
    through the sampler pick_sampler gives it: a row without the new fields gets what
    today's sampler gives it."""
    V, steps = 40, 10
    logits = [torch.randn(len(MIXED), V, generator=torch.Generator().manual_seed(t)) for t in range(steps)]
    batch = slots_for(MIXED, V, seeds=[10 + i for i in range(len(MIXED))], prompts=[[1, 2]] * len(MIXED))
    got = torch.stack([sample_penalized(x.clone(), batch) for x in logits])  # (steps, B)
    assert len(set(got.flatten().tolist())) > 10
    for i, p in enumerate(MIXED):
        alone = slots_for([p], V, seeds=[10 + i], prompts=[[1, 2]])
        pick = pick_sampler([p], False, SAMPLER_TILES)
        assert (pick is sample_penalized) == p.penalized
        assert [pick(x[i : i + 1].clone(), alone).item() for x in logits] == got[:, i].tolist(), i
        if p.penalized:
            assert torch.equal(alone.counts[0], batch.counts[i])


def test_a_reassigned_slot_starts_with_no_counts_and_no_bias():
    slots = slots_for([SamplingParams(logit_bias={2: 5.0}, frequency_penalty=1.0)], 8)
    for t in (2, 2, 7):
        count_tokens(torch.tensor([t]), slots)
    slots.set_slot(0, SamplingParams(presence_penalty=1.0), 0, [3])
    assert not slots.counts.any() and not slots.logit_bias.any() and slots.seen[0].tolist() == [j == 3 for j in range(8)]
    with pytest.raises(ValueError, match="logit_bias holds token id 8"):
        slots.set_slot(0, SamplingParams(logit_bias={8: 1.0}), 0, [])


def test_pick_sampler_routes_penalized_batches_to_a_sampler_that_applies_them():
    from fastmamba.core.sampling import sample_greedy

    greedy, biased = SamplingParams(), SamplingParams(logit_bias={1: 1.0})
    assert pick_sampler([greedy], False, SAMPLER_TILES) is sample_greedy
    assert pick_sampler([greedy, biased], False, SAMPLER_TILES) is sample_penalized
    assert pick_sampler([SamplingParams(temperature=1.0)], False, SAMPLER_TILES) is sample
    pytest.importorskip("triton")
    from fastmamba.kernels import sampler

    def picked(params):
        pick = pick_sampler(params, True, SAMPLER_TILES)
        assert pick is pick_sampler(params, True, SAMPLER_TILES)
        return pick.func, pick.keywords

    penalties = {"tiles": SAMPLER_TILES, "penalties": True}
    assert picked([greedy, biased]) == (sampler.sample_temperature, penalties)
    assert picked([SamplingParams(temperature=1.0, top_k=3, presence_penalty=0.1)]) == (sampler.sample_filtered_apart, penalties)
    assert picked([MIXED[5], greedy]) == (sampler.sample_filtered, penalties)
    assert picked([SamplingParams(temperature=1.0)]) == (sampler.sample_temperature, {"tiles": SAMPLER_TILES})


# -- the Triton samplers ----------------------------------------------------------------------


@pytest.mark.parametrize("name", ["sample_filtered", "sample_filtered_apart", "sample_temperature"])
def test_triton_samplers_with_penalties_match_sample_penalized(name):
    """kernels/sampler.py with penalties=True draws sample_penalized's tokens and leaves its
    steps, seen marks and counts, rows with and without the new fields side by side (under
    Triton's interpreter on the CPU, compiled on a GPU)."""
    pytest.importorskip("triton")
    from fastmamba.kernels import sampler

    params = list(MIXED)
    if name == "sample_temperature":
        params = [replace(p, top_k=0, top_p=1.0, min_p=0.0) for p in params]
    if name == "sample_filtered_apart":
        params = [replace(p, top_p=1.0) if p.top_k else p for p in params]
    B, V = len(params), 300
    tiles = replace(SAMPLER_TILES, cap=64)

    def slots():
        return slots_for(params, V, seeds=[100 + i for i in range(B)], prompts=[[1, 2, 3, 40 * i] for i in range(B)],
                         device=DEVICE)

    ours, ref = slots(), slots()
    picked = []
    for t in range(6):
        logits = torch.randn(B, V, generator=torch.Generator().manual_seed(30 + t)).to(DEVICE)
        expected = sample_penalized(logits.clone(), ref)
        got = getattr(sampler, name)(logits.clone(), ours, tiles, penalties=True)
        assert torch.equal(got, expected), t
        picked.append(got)
    for field in ("step", "seen", "counts"):
        assert torch.equal(getattr(ours, field), getattr(ref, field)), field
    assert ours.counts.sum().item() == 6 * B and len(set(torch.stack(picked).flatten().tolist())) > 8
    assert 17 not in torch.stack(picked)[:, 3].tolist()  # its bias of -100


# -- the engine -------------------------------------------------------------------------------

_rids = iter(range(1 << 30))


@pytest.fixture(scope="module")
def lm():
    return fastmamba.load()


def run(core: EngineCore, params: list[SamplingParams], prompts: list[list[int]]) -> list[list[int]]:
    reqs = [Request(next(_rids), ids, p) for ids, p in zip(prompts, params)]
    for r in reqs:
        core.add(r)
    got = {r.rid: [] for r in reqs}
    for _ in range(10_000):
        for out in core.step():
            if isinstance(out, Token):
                got[out.rid].append(out.token)
            else:
                assert isinstance(out, Finished), out
        if not core.has_work:
            return [got[r.rid] for r in reqs]
    raise AssertionError("the engine did not finish")


def engine_params() -> list[SamplingParams]:
    return [replace(p, max_tokens=6 + 2 * i, seed=i, stop_token_ids=[]) for i, p in enumerate(MIXED)]


def test_the_engine_gives_each_request_what_it_gets_alone(lm):
    """More requests than slots (slots reused, rows moved), prompts of several lengths,
    against generate alone; the penalties change the tokens."""
    core = EngineCore(lm.model, lm.prefill, max_batch=3, prefill_tokens=16, threads=lm.threads)
    prompts = [lm.encode(t) for t in ("To be, or not to be", "ROMEO.", "a", "Now is the winter", "O", "What")]
    params = engine_params()
    got = run(core, params, prompts)
    for ids, p, tokens in zip(prompts, params, got):
        assert tokens == lm.generate(ids, p).token_ids
    plain = lm.generate(prompts[0], max_tokens=12, stop_token_ids=[]).token_ids
    penalized = lm.generate(prompts[0], max_tokens=12, stop_token_ids=[], presence_penalty=2.0).token_ids
    # greedy, the text repeats 12 and 290 by its 10th token; penalized it moves on
    assert plain[:8] == penalized[:8] and set(plain[8:10]) <= set(plain[:8]) and not set(penalized[8:10]) & set(plain[:8])
    forced = lm.generate(prompts[0], max_tokens=5, logit_bias={77: 100.0}).token_ids
    assert forced == [77] * 5


def test_a_slot_reused_by_a_new_request_keeps_nothing_of_the_last(lm):
    """One slot, requests in turn: a bias must not reach the next request, nor counts the
    next one with penalties (the same request twice: the first's counts, left behind,
    would weigh on exactly the tokens the second picks). Each gets what a fresh engine
    gives it."""
    prompt = lm.encode("To be, or not to be")
    biased = SamplingParams(max_tokens=8, logit_bias={50: 100.0}, frequency_penalty=2.0, stop_token_ids=[])
    plain = SamplingParams(max_tokens=8, stop_token_ids=[])
    counted = SamplingParams(max_tokens=8, temperature=0.9, seed=4, frequency_penalty=2.0, stop_token_ids=[])
    core = EngineCore(lm.model, lm.prefill, max_batch=1, threads=lm.threads)
    got = [run(core, [p], [prompt])[0] for p in (biased, plain, counted, counted)]
    assert got[0] == [50] * 8
    for p, tokens in zip((plain, counted), got[1:3]):
        fresh = EngineCore(lm.model, lm.prefill, max_batch=1, threads=lm.threads)
        assert tokens == run(fresh, [p], [prompt])[0]
    assert got[3] == got[2] and len(set(got[2])) > 4


def test_generate_checks_the_bias_ids_against_the_vocabulary(lm):
    with pytest.raises(ValueError, match="logit_bias.*4096"):
        lm.generate("a", logit_bias={4096: 1.0})
    with pytest.raises(ValueError, match="presence_penalty"):
        lm.generate("a", presence_penalty=2.5)


@pytest.mark.parametrize("field, value", [
    ("presence_penalty", 2.01), ("presence_penalty", float("nan")), ("frequency_penalty", -3), ("frequency_penalty", "1"),
    ("logit_bias", {1: 100.5}), ("logit_bias", {-1: 1.0}), ("logit_bias", {"1": 1.0}), ("logit_bias", [1]),
    ("logit_bias", {i: 1.0 for i in range(301)}), ("logit_bias", {1: True}),
])
def test_invalid_values_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"^SamplingParams.{field} "):
        SamplingParams(**{field: value})


def test_the_fields_cross_to_the_engine_process():
    from fastmamba.engine import protocol

    sent = protocol.Request(1, [1], SamplingParams(logit_bias={5: -3.0, 7: 2}, frequency_penalty=0.5))
    got = protocol.decoder(protocol.ToEngine).decode(protocol.encoder().encode(sent))
    assert got.params.logit_bias == {5: -3.0, 7: 2.0} and got.params.frequency_penalty == 0.5 and got.params.penalized


# -- the server -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server():
    pytest.importorskip("openai")
    pytest.importorskip("fastapi")
    from test_server import Server

    s = Server("--max-batch", "4", "--served-model-name", "tiny")
    yield s
    s.stop()


def test_the_server_takes_the_fields(server, lm):
    c = server.client()
    kw = dict(max_tokens=12, temperature=0.8, seed=5, presence_penalty=0.6, frequency_penalty=1.1)
    out = c.completions.create(model="tiny", prompt="To be, or not to be", logit_bias={"259": -100, "77": 3}, **kw)
    want = lm.generate("To be, or not to be", logit_bias={259: -100, 77: 3}, **kw)
    assert out.choices[0].text == want.text and out.usage.completion_tokens == len(want.token_ids)
    assert want.token_ids != lm.generate("To be, or not to be", **kw).token_ids
    chat = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                     logit_bias={"77": 100})
    assert chat.choices[0].message.content == lm.tokenizer.decode([77] * 4)


@pytest.mark.parametrize("field, value, says", [
    ("logit_bias", {"abc": 1}, "abc"),
    ("logit_bias", {"5": 200}, "200"),
    ("logit_bias", {"5": "x"}, "x"),
    ("logit_bias", {"4096": 1}, "4096"),
    ("logit_bias", [5], "object"),
    ("logit_bias", {str(i): 1 for i in range(301)}, "300"),
    ("presence_penalty", 3, "presence_penalty"),
    ("frequency_penalty", "x", "frequency_penalty"),
    ("frequency_penalty", -2.5, "frequency_penalty"),
])
def test_bad_values_are_400s_naming_the_field(server, field, value, says):
    status, err = server.post("/v1/completions", {"model": "tiny", "prompt": "x", field: value})
    assert status == 400 and err["error"]["param"] == field and says in err["error"]["message"], err


# -- on the GPU -------------------------------------------------------------------------------


@pytest.mark.gpu
def test_the_gpu_engine_generates_what_the_cpu_reference_engine_does(tmp_path):
    """float32 at 130m's vocabulary: the GPU engine (Triton samplers with penalties, a
    batch of mixed requests, deterministic) against the CPU reference engine, request by
    request; greedy rows compare exactly, as the float32 logits agree to 1e-6."""
    path = save_hf_checkpoint(tmp_path / "m", seed=5, hidden_size=256, num_hidden_layers=2, vocab_size=50280)
    cpu = fastmamba.load(path)
    gpu = fastmamba.load(path, device="cuda", deterministic=True)
    params = [replace(p, max_tokens=16, stop_token_ids=[], temperature=0.0, top_k=0, top_p=1.0, min_p=0.0)
              for p in engine_params()] + [SamplingParams(max_tokens=16, stop_token_ids=[], logit_bias={123: 100})]
    prompts = [[11 + i, 22, 33, 44, 55] for i in range(len(params))]
    batch = gpu.generate_batch(prompts, params)
    for ids, p, out in zip(prompts, params, batch):
        want = cpu.generate(ids, p).token_ids
        assert out.token_ids == want and gpu.generate(ids, p).token_ids == want
    assert batch[-1].token_ids == [123] * 16
    hot = engine_params()  # sampling rows: the GPU engine's batch against itself alone
    hot_batch = gpu.generate_batch(prompts[: len(hot)], hot)
    assert [g.token_ids for g in hot_batch] == [gpu.generate(ids, p).token_ids for ids, p in zip(prompts, hot)]
