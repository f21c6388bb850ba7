"""The device-side sampler: each option does what it says, and the random streams are sound."""

from __future__ import annotations

import pytest
import torch

from fastmamba.core.sampling import SlotParams, hash32, sample, uniforms, unit_floats
from fastmamba.core.sampling_params import SamplingParams


def slots_for(params: list[SamplingParams], vocab: int, seeds=None, seen=None) -> SlotParams:
    slots = SlotParams.empty(len(params), vocab, "cpu")
    for i, p in enumerate(params):
        slots.set_slot(i, p, seeds[i] if seeds else i, seen[i] if seen else [])
    return slots


LOGITS = torch.tensor([1.0, 3.0, 2.5, -1.0, 0.5, 2.9, -4.0, 0.0])


def draw(params: SamplingParams, n: int = 4000, logits=LOGITS) -> torch.Tensor:
    """n independent draws: n slots with n different seeds."""
    slots = slots_for([params] * n, logits.numel(), seeds=list(range(n)))
    return sample(logits.expand(n, -1).clone(), slots)


def test_greedy_is_argmax():
    assert draw(SamplingParams(), n=3).tolist() == [1, 1, 1]


def test_temperature_sampling_follows_softmax():
    tokens = draw(SamplingParams(temperature=0.7), n=20000)
    freq = torch.bincount(tokens, minlength=8).float() / tokens.numel()
    expected = torch.softmax(LOGITS / 0.7, -1)
    assert (freq - expected).abs().max() < 0.015


def test_top_k_keeps_the_k_best():
    tokens = set(draw(SamplingParams(temperature=5.0, top_k=3)).tolist())
    assert tokens == {1, 5, 2}
    assert set(draw(SamplingParams(temperature=5.0, top_k=1)).tolist()) == {1}


def test_top_p_keeps_the_smallest_nucleus():
    probs = torch.softmax(LOGITS, -1)
    order = probs.argsort(descending=True)
    # mass of the top two is below 0.8 and of the top three above it: three tokens survive
    assert probs[order[:2]].sum() < 0.8 < probs[order[:3]].sum()
    assert set(draw(SamplingParams(temperature=1.0, top_p=0.8)).tolist()) == set(order[:3].tolist())
    assert set(draw(SamplingParams(temperature=1.0, top_p=1e-6)).tolist()) == {1}


def test_min_p_drops_unlikely_tokens():
    probs = torch.softmax(LOGITS, -1)
    kept = set(torch.nonzero(probs >= 0.5 * probs.max()).flatten().tolist())
    assert set(draw(SamplingParams(temperature=1.0, min_p=0.5)).tolist()) == kept
    assert set(draw(SamplingParams(temperature=1.0, min_p=1.0)).tolist()) == {1}


def test_repetition_penalty_flips_the_argmax():
    logits = torch.tensor([[0.0, 2.0, 1.5, -1.0]])
    plain = sample(logits.clone(), slots_for([SamplingParams()], 4, seen=[[1]]))
    penalized = sample(logits.clone(), slots_for([SamplingParams(repetition_penalty=2.0)], 4, seen=[[1]]))
    assert plain.item() == 1 and penalized.item() == 2  # 2.0 / 2 = 1.0 < 1.5
    # a negative logit is multiplied, pushing it further down
    neg = torch.tensor([[-0.5, -0.6, -3.0, -3.0]])
    assert sample(neg.clone(), slots_for([SamplingParams(repetition_penalty=1.5)], 4, seen=[[0]])).item() == 1


def test_same_seed_same_tokens_and_steps_advance():
    p = SamplingParams(temperature=1.0)
    slots_a = slots_for([p], 8, seeds=[42])
    slots_b = slots_for([p], 8, seeds=[42])
    a = [sample(LOGITS[None].clone(), slots_a).item() for _ in range(50)]
    b = [sample(LOGITS[None].clone(), slots_b).item() for _ in range(50)]
    assert a == b and len(set(a)) > 2
    assert slots_a.step.item() == 50


def test_a_slot_draws_the_same_alone_or_in_a_batch():
    p = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.5, top_k=4), SamplingParams()]
    batch = sample(LOGITS.expand(3, -1).clone(), slots_for(p, 8, seeds=[7, 8, 9]))
    alone = [sample(LOGITS[None].clone(), slots_for([p[i]], 8, seeds=[7 + i])).item() for i in range(3)]
    assert batch.tolist() == alone


def test_uniforms_are_uniform_and_independent():
    u = uniforms(torch.arange(64), torch.zeros(64, dtype=torch.int64), 1000)
    assert 0 < u.min() and u.max() < 1
    assert abs(u.mean().item() - 0.5) < 0.01
    assert abs(torch.corrcoef(torch.stack([u[:, :-1].flatten(), u[:, 1:].flatten()]))[0, 1].item()) < 0.02
    again = uniforms(torch.arange(64), torch.ones(64, dtype=torch.int64), 1000)
    assert not torch.equal(u, again)


def test_hash32_stays_in_32_bits():
    x = torch.tensor([0, 1, 2**32 - 1, 123456789], dtype=torch.int64)
    h = hash32(x)
    assert ((h >= 0) & (h < 2**32)).all() and len(set(h.tolist())) == 4


@pytest.mark.parametrize(
    "field,value",
    [
        ("max_tokens", 0),
        ("max_tokens", 2.5),
        ("temperature", -0.1),
        ("temperature", float("nan")),
        ("top_k", -1),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("min_p", 2.0),
        ("repetition_penalty", 0.0),
        ("seed", -3),
        ("seed", "abc"),
        ("stop_token_ids", "eos"),
        ("stop_token_ids", [1, -2]),
    ],
)
def test_invalid_values_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_unknown_option_is_named():
    with pytest.raises(TypeError, match="temprature"):
        SamplingParams.from_kwargs(None, {"temprature": 1.0})


def test_pick_sampler_chooses_by_the_requests_and_engine():
    """Greedy requests get the argmax alone; the reference engine gets `sample` for the
    rest; the GPU engine the Triton sampler that does no more than the requests need
    (tested against `sample` in tests/test_kernels.py), with the plan's tiles, the same
    object each time (the engine captures a CUDA graph per sampler)."""
    from fastmamba.core.sampling import pick_sampler, sample_greedy
    from fastmamba.engine.plan import SAMPLER_TILES

    greedy, hot = SamplingParams(), SamplingParams(temperature=0.8)
    top_k, top_p = SamplingParams(temperature=0.8, top_k=40), SamplingParams(temperature=0.8, top_p=0.9)
    both = SamplingParams(temperature=0.8, top_k=40, top_p=0.9)
    assert pick_sampler([greedy, greedy], True, SAMPLER_TILES) is sample_greedy
    assert pick_sampler([greedy, SamplingParams(repetition_penalty=1.2)], False, SAMPLER_TILES) is sample
    assert pick_sampler([hot, both], False, SAMPLER_TILES) is sample
    pytest.importorskip("triton")  # without it the GPU engine gets `sample` too
    from fastmamba.kernels import sampler

    def picked(params):
        pick = pick_sampler(params, True, SAMPLER_TILES)
        assert pick is pick_sampler(params, True, SAMPLER_TILES) and pick.keywords == {"tiles": SAMPLER_TILES}
        return pick.func

    assert picked([greedy, hot]) is sampler.sample_temperature
    assert picked([hot, top_k, top_p]) is sampler.sample_filtered_apart
    assert picked([SamplingParams(temperature=0.8, min_p=0.1)]) is sampler.sample_filtered_apart
    assert picked([top_p, both]) is sampler.sample_filtered


def test_unit_floats_stay_below_one_and_a_masked_token_is_never_drawn():
    """The largest hashes (top 24 bits all ones) once rounded to a uniform of exactly 1: a
    Gumbel key of +inf, NaN beside a masked logit, which argmax picked."""
    h = torch.tensor([0xFFFFFFFF, 0xFFFFFF00, 0xFFFFFE00, 0, 0xFF], dtype=torch.int64)
    u = unit_floats(h)
    assert (u < 1).all() and (u > 0).all() and u[0] == u[1] == 1 - 2.0**-24
    assert u[2] < u[0] and u[3] == u[4] == 0.5 / (1 << 24)
    keys = -torch.log(-torch.log(u))
    assert torch.isfinite(keys).all()
    masked = torch.tensor([float("-inf"), 0.0, float("-inf"), float("-inf"), 1.0])
    assert (masked + keys).argmax() in (1, 4)
