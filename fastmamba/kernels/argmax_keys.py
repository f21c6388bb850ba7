"""Keys for an argmax that the GPU's programs can take in any order: each program offers its
outputs' largest key per row to an atomic max over int64 keys that order as (value, then
the lower index) do, so a row's argmax needs no pass over the logits and the order of the
programs cannot change it (ties go to the lower index, as in torch.argmax; NaN is the
largest). Used by the decode step's greedy lm_head (decode_step.py) and the samplers
(sampler.py); `advance_slots` moves a slot's sampling state on after a draw, for both.
"""

from __future__ import annotations

from ._triton import jit, tl

ARGMAX_EMPTY = -(2**63)  # the key no output's beats: `best` before lm_head's programs
EMPTY_KEY = tl.constexpr(ARGMAX_EMPTY)
LOW32 = tl.constexpr(2**32 - 1)


@jit
def ordered_bits(v):
    """float32 v -> int32 that order as the values do (NaN aside)."""
    return flip_negative((v + 0.0).to(tl.int32, bitcast=True))  # + 0.0: -0.0 ties with 0.0


@jit
def flip_negative(bits):
    """float32 bits with a negative value's magnitude bits reversed: float bits -> ordered
    int32 (ordered_bits) and back, being its own inverse."""
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


@jit
def argmax_keys(v, n, nmask):
    """(1, BN) float32 values of outputs n -> int64 keys: the value's bits made to order
    as signed integers in the high half, 2^32 - 1 - n in the low; masked outputs lowest."""
    key = tl.where(v != v, 0x7FFFFFFF, ordered_bits(v))
    low = LOW32 - n.to(tl.int64)
    packed = (key.to(tl.int64) << 32) | low[None, :]
    return tl.where(nmask[None, :], packed, EMPTY_KEY)


@jit
def token_of_key(key):
    """The output (token id) an argmax_keys key stands for."""
    return LOW32 - (key & LOW32)


@jit
def advance_slots(tok, rows, m, step_ptr, seen_ptr, V, BR: tl.constexpr):
    """After a token is drawn for each slot: step + 1 and the token marked seen, as
    sampling.sample and sample_greedy do."""
    tl.store(step_ptr + rows, tl.load(step_ptr + rows, mask=m, other=0) + 1, mask=m)
    tl.store(seen_ptr + rows.to(tl.int64) * V + tok, tl.full([BR], 1, tl.int1), mask=m)
