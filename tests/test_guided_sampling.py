"""Structured output's token mask inside the samplers: every sampler pick_sampler can return
draws, from logits and a bitmask, the token it draws from the logits with the forbidden
tokens at -inf (same seeds, the same tokens), and never a forbidden one.

The Triton samplers run in Triton's interpreter on the CPU (TRITON_INTERPRET=1, set in
conftest) at small shapes, and on the GPU in the `gpu` test at a public vocabulary's.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from fastmamba.core.sampling import (
    SlotParams,
    allowed,
    masked,
    pick_sampler,
    sample,
    sample_greedy,
    sample_penalized,
)
from fastmamba.core.sampling_params import SamplingParams
from fastmamba.engine.plan import SAMPLER_TILES

HOT = dict(temperature=20.0)  # a flat distribution: a forbidden token would be drawn often
KINDS = {  # a sampler kind: its rows' parameters (cycled over the batch)
    "greedy": [dict()],
    "temperature": [dict(temperature=0.8), HOT, dict(), dict(repetition_penalty=1.3), dict(temperature=1.0,
                                                                                          repetition_penalty=1.2)],
    "filtered_apart": [dict(temperature=0.9, top_k=5), dict(temperature=1.3, top_p=0.9), dict(temperature=1.0, min_p=0.1),
                       dict(temperature=20.0, top_k=200),  # more tokens than a sparse row allows
                       dict(temperature=20.0, top_p=0.999), dict()],
    "filtered": [dict(temperature=2.0, top_k=40, top_p=0.8), dict(temperature=20.0, top_k=250, top_p=0.99, min_p=0.01),
                 dict(temperature=0.7, top_k=3), dict(repetition_penalty=1.2)],
    "penalized": [dict(temperature=1.0, presence_penalty=0.5, frequency_penalty=0.3), dict(logit_bias={7: 5.0, 11: -3.0}),
                  dict(temperature=20.0, presence_penalty=1.0, logit_bias={1: 20.0})],
    "penalized_filtered": [dict(temperature=20.0, top_k=150, top_p=0.95, presence_penalty=1.0, logit_bias={1: 20.0}),
                           dict(temperature=1.0, min_p=0.05, frequency_penalty=0.7), dict(logit_bias={4: 9.0})],
}


def samplers(kind: str, params: list[SamplingParams], triton: bool, tiles):
    """(the sampler under test, the oracle: `sample` or its twins without a bitmask)."""
    penalized = kind.startswith("penalized")
    oracle = sample_greedy if kind == "greedy" else sample_penalized if penalized else sample
    if not triton:
        picked = pick_sampler(params, False, tiles)
        assert picked is oracle
        return picked, oracle
    pytest.importorskip("triton")
    from fastmamba.kernels import sampler

    picked = pick_sampler(params, True, tiles)  # (a guided request: the greedy batch's Triton argmax too)
    func = {"greedy": sampler.sample_greedy, "temperature": sampler.sample_temperature,
            "filtered_apart": sampler.sample_filtered_apart, "filtered": sampler.sample_filtered,
            "penalized": sampler.sample_temperature, "penalized_filtered": sampler.sample_filtered}
    assert picked.func is func[kind] and picked.keywords.get("penalties", False) == penalized
    return picked, oracle


def pack(ok: torch.Tensor) -> torch.Tensor:
    """(B, V) bool -> xgrammar's int32 (B, ceil(V/32)) bitmask: bit j % 32 of word j // 32."""
    B, V = ok.shape
    bits = torch.zeros(B, (V + 31) // 32 * 32, dtype=torch.int64)
    bits[:, :V] = ok.long()
    words = (bits.view(B, -1, 32) << torch.arange(32)).sum(-1)  # (B, W) in [0, 2^32)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def random_allowed(B: int, V: int, seed: int) -> torch.Tensor:
    """(B, V) bool: row 0 allows every token, row 1 one token, the others a random share."""
    g = torch.Generator().manual_seed(seed)
    density = torch.rand(B, 1, generator=g) * 0.6 + 0.05
    ok = torch.rand(B, V, generator=g) < density
    ok[0] = True
    ok[1] = False
    ok[1, int(torch.randint(V, (1,), generator=g))] = True
    ok[:, 0] |= ~ok.any(-1)  # (a row allows at least one token)
    return ok


def slot_params(params: list[SamplingParams], V: int, device) -> SlotParams:
    s = SlotParams.empty(len(params), V, device)
    s.set_slots([(p, 1000 + i, [2, 3, 5 * i]) for i, p in enumerate(params)])
    return s


def check_kind(kind: str, triton: bool, device, V: int, tiles, B: int = 8, steps: int = 3) -> None:
    params = [SamplingParams(guide=("json_object", ""), **KINDS[kind][i % len(KINDS[kind])]) for i in range(B)]
    ours, oracle = samplers(kind, params, triton, tiles)
    slots, ref = slot_params(params, V, device), slot_params(params, V, device)
    g = torch.Generator().manual_seed(len(kind))
    for t in range(steps):
        ok = random_allowed(B, V, seed=10 * t + len(kind))
        bitmask = pack(ok).to(device)
        assert torch.equal(allowed(bitmask, V).cpu(), ok)
        logits = (torch.randn(B, V, generator=g) * 3).to(device)
        logits[1:] += torch.where(ok[1:], 0.0, 8.0).to(device)  # the forbidden tokens the likeliest
        got = ours(logits.clone(), slots, bitmask=bitmask)
        want = oracle(logits.masked_fill(~ok.to(device), float("-inf")), ref)
        assert torch.equal(got, want), (kind, t, got.tolist(), want.tolist())
        assert ok.gather(1, got.cpu()[:, None]).all()
    for name in ("step", "seen", "counts"):
        assert torch.equal(getattr(slots, name), getattr(ref, name)), name


def check_never_forbidden(kind: str, triton: bool, device, V: int, tiles, B: int = 48) -> None:
    """B seeds, each a row whose forbidden tokens are far the likeliest: none is drawn."""
    params = [SamplingParams(guide=("json_object", ""), seed=s, **KINDS[kind][s % len(KINDS[kind])])
              for s in range(B)]
    ours, _ = samplers(kind, params, triton, tiles)
    slots = slot_params(params, V, device)
    ok = random_allowed(B, V, seed=99)
    ok[0] = ok[2]  # (this test's row 0 is guided too)
    bitmask = pack(ok).to(device)
    logits = torch.randn(B, V, generator=torch.Generator().manual_seed(5)).to(device)
    logits += torch.where(ok, 0.0, 30.0).to(device)
    for _ in range(2):
        got = ours(logits, slots, bitmask=bitmask)
        assert ok.gather(1, got.cpu()[:, None]).all(), kind


# V: not a multiple of 32 (the last word's high bits stand for no token); tiles: several
# programs a row, and a search that narrows its band before it gathers
CPU_TILES = replace(SAMPLER_TILES, bv=128, cap=64, rounds=2)


@pytest.mark.parametrize("triton", [False, True], ids=["torch", "triton"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_a_bitmask_samples_as_forbidden_logits_at_minus_inf(kind, triton):
    check_kind(kind, triton, "cpu", 300, CPU_TILES)


@pytest.mark.parametrize("triton", [False, True], ids=["torch", "triton"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_a_forbidden_token_is_never_drawn(kind, triton):
    # (16 rows in the interpreter: unmasked, each would draw a forbidden token almost surely)
    check_never_forbidden(kind, triton, "cpu", 300, CPU_TILES, B=16)


def test_rows_all_allowed_sample_as_without_a_bitmask():
    params = [SamplingParams(**kw) for kw in KINDS["filtered"]]
    V = 300
    a, b = slot_params(params, V, "cpu"), slot_params(params, V, "cpu")
    logits = torch.randn(len(params), V, generator=torch.Generator().manual_seed(3))
    everything = torch.full((len(params), (V + 31) // 32), -1, dtype=torch.int32)
    assert torch.equal(sample(logits, a, everything), sample(logits, b))
    assert masked(logits, None) is logits


def test_the_bitmask_is_xgrammars_layout():
    """sampling.allowed reads a bitmask as xgrammar's own masking kernel does."""
    xgrammar = pytest.importorskip("xgrammar")
    B, V = 4, 300
    ok = random_allowed(B, V, seed=7)
    bitmask = xgrammar.allocate_token_bitmask(B, V)
    bitmask.copy_(pack(ok))
    logits = torch.randn(B, V)
    theirs = logits.clone()
    xgrammar.apply_token_bitmask_inplace(theirs, bitmask)
    assert torch.equal(masked(logits, bitmask), theirs)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", list(KINDS))
def test_on_the_gpu_a_bitmask_samples_as_forbidden_logits_at_minus_inf(kind):
    """The Triton samplers with the plan's tiles at a public vocabulary's width."""
    check_kind(kind, True, "cuda", 50280, SAMPLER_TILES, B=16, steps=4)
    check_never_forbidden(kind, True, "cuda", 50280, SAMPLER_TILES, B=256)
