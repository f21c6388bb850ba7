"""Sampling on the GPU in Triton kernels: the tokens sampling.sample draws, without its sort.

sampling.sample (the oracle, and the CPU path) is ~85 small torch kernels a step with a
sort of the vocabulary: 270 µs at batch 1 and 2 ms at batch 128 on an H200
(benchmarks/sampling_speed.py), more than the whole 130m decode step. Here:

    _scale_kernel   (structured output only) a token its row's bitmask forbids read as
                    -inf; (penalties only) OpenAI's logit bias, presence and frequency
                    penalties; repetition penalty, each row's greedy argmax, logits /
                    temperature (s), each row's largest s
    (filters only)  the key of the last token top-k / top-p / min-p keep (_filter_keys:
                    a few passes that count, no sort of the vocabulary)
    _pick_kernel    Gumbel noise from the same counter-based hash, each row's argmax of
                    the kept tokens' s + noise
    _finish_kernel  greedy or sampled token per row; step + 1; the token marked seen (and
                    with penalties, counted)

`sample_greedy` is the argmax alone, for greedy batches with a bitmask (`_greedy_kernel`).
A bitmask (structured output) is xgrammar's: int32 (B, ceil(V/32)), bit j % 32 of word
j // 32 set where token j is allowed; the first pass reads it beside the logits, so that a
guided row costs the others nothing (no masked copy of the logits, no pass of its own).

The argmaxes are atomic maxima over int64 keys that order as (value, lower index) do
(decode_step.argmax_keys), so the order of programs cannot change a token.
`sample_temperature` serves rows without filters, `sample_filtered_apart` rows none of
which combines top-k with top-p, `sample_filtered` any row; all take and update
SlotParams exactly as `sample` does, or with penalties=True as `sample_penalized` does. Where `sample` sums probabilities in its sorted
order, the search sums weights in fixed point in any order: a token whose mass ranked
before it lies within float rounding of top_p may fall on the other side (never seen in
the tests).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._triton import INTERPRET, jit, tl, triton
from .argmax_keys import (
    ARGMAX_EMPTY,
    LOW32,
    advance_slots,
    argmax_keys,
    flip_negative,
    ordered_bits,
    token_of_key,
)


@dataclass(frozen=True)
class SamplerTiles:
    """The samplers' launch settings (the chosen ones: engine/plan.py's SAMPLER_TILES)."""

    bv: int  # tokens a program of the passes over a row
    nb: int  # the filters' search: thresholds a pass (see _filter_keys)
    cap: int  # tokens gathered and sorted at its end (a band narrowed to at most this many)
    rounds: int  # passes over many programs before the gather (then one program narrows alone)


@jit
def _hash32(x):
    """sampling.hash32 on int64 tensors (values below 2^32 in, below 2^32 out)."""
    x = x & LOW32
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & LOW32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & LOW32
    return x ^ (x >> 16)


@jit
def _log(x):
    # the GPU's libdevice log is CUDA's logf, as torch's; the interpreter runs numpy's
    if INTERPRET:
        return tl.log(x)
    else:
        return tl.extra.cuda.libdevice.log(x)


@jit
def _gumbel(seed, step, ids):
    """-log(-log(u)) for sampling.uniforms(seed, step)[ids]: the same hash, the same floats."""
    key = _hash32(seed * 0x9E37 + _hash32(step))
    h = _hash32(key ^ _hash32(ids + 0x632BE5AB))
    u = tl.minimum(((h >> 8).to(tl.float32) + 0.5) * (1.0 / (1 << 24)), 0.99999994039535522)  # (below 1, as uniforms)
    return -_log(-_log(u))


@jit
def _allowed_logits(logits_ptr, mask_ptr, row, i, m, V, MASKED: tl.constexpr):
    """A row's logits at tokens i (m: which are tokens), float32; with MASKED, -inf where the
    row's bitmask (sampling.allowed's layout) forbids the token."""
    x = tl.load(logits_ptr + row * V + i, mask=m, other=0.0).to(tl.float32)
    if MASKED:
        word = tl.load(mask_ptr + row * tl.cdiv(V, 32) + (i >> 5), mask=m, other=0)
        x = tl.where(((word >> (i & 31)) & 1) != 0, x, -float("inf"))
    return x


@jit
def _scale_kernel(
    logits_ptr, seen_ptr, pen_ptr, temp_ptr, s_ptr, best_ptr, smax_ptr, bias_ptr, count_ptr, presence_ptr,
    frequency_ptr, mask_ptr, V, PENALTIES: tl.constexpr, MASKED: tl.constexpr, BV: tl.constexpr,
):
    # s = penalised logits / temperature; each row's greedy key into best[row], its
    # largest s into smax[row]. MASKED: a token the row's bitmask forbids is -inf (and
    # stays so through every step below). PENALTIES: OpenAI's first, rounded step by step
    # as sampling.penalize (launched without fused multiply-adds)
    row = tl.program_id(1).to(tl.int64)
    i = tl.program_id(0) * BV + tl.arange(0, BV)
    m = i < V
    x = _allowed_logits(logits_ptr, mask_ptr, row, i, m, V, MASKED)
    if PENALTIES:
        count = tl.load(count_ptr + row * V + i, mask=m, other=0)
        x = x + tl.load(bias_ptr + row * V + i, mask=m, other=0.0)
        x = x - tl.where(count > 0, tl.load(presence_ptr + row), 0.0)
        x = x - tl.load(frequency_ptr + row) * count.to(tl.float32)
    pen = tl.load(pen_ptr + row)
    seen = tl.load(seen_ptr + row * V + i, mask=m, other=0) != 0
    x = tl.where(seen, tl.where(x > 0, x / pen, x * pen), x)
    tl.atomic_max(best_ptr + row, tl.max(argmax_keys(x[None, :], i, m), axis=None), sem="relaxed")
    t = tl.maximum(tl.load(temp_ptr + row), 1e-6)
    tl.store(s_ptr + row * V + i, x / t, mask=m)
    tl.atomic_max(smax_ptr + row, tl.max(tl.where(m, x / t, -float("inf")), 0), sem="relaxed")


@jit
def _greedy_kernel(logits_ptr, mask_ptr, best_ptr, V, MASKED: tl.constexpr, BV: tl.constexpr):
    # Each row's argmax key (of the allowed tokens, with MASKED) into best[row]
    row = tl.program_id(1).to(tl.int64)
    i = tl.program_id(0) * BV + tl.arange(0, BV)
    m = i < V
    x = _allowed_logits(logits_ptr, mask_ptr, row, i, m, V, MASKED)
    tl.atomic_max(best_ptr + row, tl.max(argmax_keys(x[None, :], i, m), axis=None), sem="relaxed")


@jit
def _pick_kernel(s_ptr, seed_ptr, step_ptr, kstar_ptr, best_ptr, V, FILTERED: tl.constexpr, BV: tl.constexpr):
    # Each row's best kept s + Gumbel noise into best[row]: every token, or with FILTERED
    # those whose key is at least kstar[row] (_filter_keys).
    row = tl.program_id(1).to(tl.int64)
    i = tl.program_id(0) * BV + tl.arange(0, BV)
    m = i < V
    s = tl.load(s_ptr + row * V + i, mask=m, other=0.0)
    keep = m
    if FILTERED:
        keep &= _keys(s, i, m, BV) >= tl.load(kstar_ptr + row)
    v = s + _gumbel(tl.load(seed_ptr + row), tl.load(step_ptr + row), i.to(tl.int64))
    tl.atomic_max(best_ptr + row, tl.max(argmax_keys(v[None, :], i, keep), axis=None), sem="relaxed")


# -- top-k, top-p and min-p without a sort ---------------------------------------------------
# Each filter keeps a prefix of `sample`'s stable descending order, so the kept tokens are
# those whose key (value, then the lower index: argmax_keys) is at least the last kept
# token's, K. _filter_keys finds K per row in a few passes over the row, each spread over many
# programs: it narrows a band of keys known to hold K (every token above the band is kept,
# none below it) by counting the band's tokens and adding up their weights exp(s - s_max)
# above NB thresholds a pass, until at most CAP tokens are left in it; those are gathered,
# sorted and walked (NB, CAP and the passes: SamplerTiles). Weights add up in fixed point
# (2^-40), so that the sums, and the tokens, cannot depend on the order of the atomic adds.
# A band still over CAP tokens after the passes (rare: very flat or tie-heavy rows) is
# narrowed further by one program (_select_alone, slow). Tokens of s = -inf (those a bitmask
# forbids) are in no band: no threshold of a value ever splits their tie, so a top-k reaching
# past a row's finite tokens would narrow forever; kept or not, their noisy s stays -inf.
KEY_MIN = tl.constexpr(ARGMAX_EMPTY + 1)  # below every token's key (masked lanes aside)
_WEIGHT_ONE = tl.constexpr(2.0**40)
# st, a selection's state per row: the band lo <= key <= hi, the tokens above it (count,
# weight), the tokens in it, done (no pass needed: the band is small, whole, or the row
# keeps every token), whole (every token of the band is kept), and the count cap
_LO, _HI, _ABOVE, _W_ABOVE, _N_BAND, _DONE, _WHOLE, _CAP = (tl.constexpr(i) for i in range(8))


@jit
def _keys(s, i, m, BV: tl.constexpr):
    """(BV,) values of tokens i -> their int64 keys; masked ones below KEY_MIN."""
    return tl.reshape(argmax_keys(s[None, :], i, m), [BV])


@jit
def _key_of_value(v):
    """The lowest key of value v: a token's key >= it exactly where its value >= v."""
    return ordered_bits(v).to(tl.int64) << 32


@jit
def _value_of_key(key):
    """The value in a key's high half (ordered_bits undone)."""
    return flip_negative((key >> 32).to(tl.int32)).to(tl.float32, bitcast=True)


@jit
def _weight(s, s0):
    """exp(s - s0) in fixed point (int64, units of 2^-40)."""
    return (tl.exp(s - s0) * _WEIGHT_ONE).to(tl.int64)


@jit
def _first_band(s0, j, like, NB: tl.constexpr):
    """The first pass's band, every token (lo, hi), and its thresholds: values
    s0 - 0.25 * 2^j, then every token. like: an int64 scalar, for lo's type."""
    T = tl.where(j < NB - 1, _key_of_value(s0 - 0.25 * tl.exp2(j.to(tl.float32))), KEY_MIN)
    return 0 * like + KEY_MIN, _key_of_value(s0) | LOW32, T


@jit
def _band_chunk(s_ptr, row, V, i, lo, hi, BV: tl.constexpr):
    """Tokens i of a row: s, which are tokens (i < V), their keys, which are in the band lo..hi
    (never one of s = -inf)."""
    m = i < V
    s = tl.load(s_ptr + row * V + i, mask=m, other=0.0)
    key = _keys(s, i, m, BV)
    return s, m, key, m & (key >= lo) & (key <= hi) & (s > -float("inf"))


@jit
def _above_thresholds(key, inb, T):
    """(BV, NB): whether a band token's key is at least T[j]."""
    return (key[:, None] >= T[None, :]) & inb[:, None]


@jit
def _store_band(scratch_ptr, row, base, key, inb, CAP: tl.constexpr):
    """The band tokens' keys into scratch[row] from place base on (never past CAP); how many."""
    pos = base + tl.cumsum(inb.to(tl.int32), 0) - 1
    tl.store(scratch_ptr + row * CAP + pos, key, mask=inb & (pos < CAP))
    return tl.sum(inb.to(tl.int32), 0).to(tl.int64)


@jit
def _needs(row, V, temp_ptr, topk_ptr, topp_ptr, minp_ptr, STAGE: tl.constexpr):
    """Whether the row samples through filters (STAGE 1), or needs the top k's weight
    first because it uses top-k and top-p together (STAGE 0); and its k (V: off)."""
    k = tl.load(topk_ptr + row)
    k = tl.where((k > 0) & (k < V), k, V)
    top_p = tl.load(topp_ptr + row)
    hot = tl.load(temp_ptr + row) > 0
    if STAGE == 0:
        return hot & (k < V) & (top_p < 1.0), k
    return hot & ((k < V) | (top_p < 1.0) | (tl.load(minp_ptr + row) > 0.0)), k


@jit
def _count_kernel(
    s_ptr, smax_ptr, st_ptr, T_ptr, cnt_ptr, mass_ptr, nmin_ptr, temp_ptr, topk_ptr, topp_ptr, minp_ptr, V,
    FIRST: tl.constexpr, STAGE: tl.constexpr, NB: tl.constexpr, BV: tl.constexpr,
):
    # One pass over a chunk of a row: its band tokens' count and weight above each
    # threshold, added to the row's sums; in the first pass (the band: every token) also
    # the count min-p keeps.
    row = tl.program_id(1).to(tl.int64)
    j = tl.arange(0, NB)
    need, k = _needs(row, V, temp_ptr, topk_ptr, topp_ptr, minp_ptr, STAGE)
    s0 = tl.load(smax_ptr + row)
    if FIRST:
        lo, hi, T = _first_band(s0, j, k, NB)
    else:
        need &= tl.load(st_ptr + row * 8 + _DONE) == 0
        lo = tl.load(st_ptr + row * 8 + _LO)
        hi = tl.load(st_ptr + row * 8 + _HI)
        T = tl.load(T_ptr + row * NB + j)
    if need:
        s, m, key, inb = _band_chunk(s_ptr, row, V, tl.program_id(0) * BV + tl.arange(0, BV), lo, hi, BV)
        ge = _above_thresholds(key, inb, T)
        tl.atomic_add(cnt_ptr + row * NB + j, tl.sum(ge.to(tl.int64), 0), sem="relaxed")
        tl.atomic_add(mass_ptr + row * NB + j, tl.sum(tl.where(ge, _weight(s, s0)[:, None], 0), 0), sem="relaxed")
        if FIRST:
            min_p = tl.load(minp_ptr + row)
            log_min_p = tl.where(min_p > 0.0, _log(tl.maximum(min_p, 1e-30)), -float("inf"))
            tl.atomic_add(nmin_ptr + row, tl.sum((m & (s - s0 >= log_min_p)).to(tl.int64), 0), sem="relaxed")


@jit
def _pick_at(x, j, at):
    """x[at] of a (NB,) tensor x (j: its positions), as a scalar; 0 where at is past x."""
    return tl.sum(tl.where(j == at, x, 0), 0)


@jit
def _narrow(cnt, mass, T, j, lo, hi, above, w_above, cap, lim, NB: tl.constexpr):
    """After a pass: the first threshold T[js] whose tokens (with those above the band)
    are not all kept; the band becomes T[js] <= key < T[js - 1], the tokens from T[js - 1]
    up join those above it. whole: every token of the band is kept (js = NB)."""
    kept = (above + cnt <= cap) & ((w_above + mass).to(tl.float64) < lim)
    js = tl.min(tl.where(kept, NB, j), 0)
    whole = js == NB
    c_prev = _pick_at(cnt, j, js - 1)  # 0 where js = 0
    n_band = tl.where(whole, 0, _pick_at(cnt, j, js) - c_prev)
    hi = tl.where(js > 0, _pick_at(T, j, js - 1) - 1, hi)
    lo = tl.where(whole, lo, _pick_at(T, j, js))
    return lo, hi, above + c_prev, w_above + _pick_at(mass, j, js - 1), n_band, whole


@jit
def _next_thresholds(lo, hi, j, NB: tl.constexpr):
    """NB thresholds from hi down to lo for the next pass: evenly spaced values where the
    band spans several (a band open below, lo = KEY_MIN, reaches down 2^j * 32 below hi);
    within one value (ties) evenly spaced keys, that is token ids (float64 arithmetic: no
    int64 overflow). Keys are no use for values: most keys are values near zero."""
    v_lo, v_hi = _value_of_key(lo), _value_of_key(hi)
    step = tl.where(lo == KEY_MIN, 32.0 * tl.exp2(j.to(tl.float32)), (v_hi - v_lo) * ((j + 1).to(tl.float32) / NB))
    by_value = _key_of_value(v_hi - step)
    lo_f, hi_f = lo.to(tl.float64), hi.to(tl.float64)
    by_key = (hi_f - (hi_f - lo_f) * ((j + 1).to(tl.float64) / NB)).to(tl.int64)
    T = tl.where((v_hi > v_lo) | (lo == KEY_MIN), by_value, by_key)
    T = tl.where(j < NB - 1, T, lo)
    return tl.minimum(tl.maximum(T, lo), hi)


@jit
def _band_state(st_ptr, lim_ptr, row):
    """A row's search as the last pass left it: the band lo <= key <= hi, the count and
    weight of the tokens above it, the count cap and the weight limit."""
    lo = tl.load(st_ptr + row * 8 + _LO)
    hi = tl.load(st_ptr + row * 8 + _HI)
    above = tl.load(st_ptr + row * 8 + _ABOVE)
    w_above = tl.load(st_ptr + row * 8 + _W_ABOVE)
    cap = tl.load(st_ptr + row * 8 + _CAP)
    return lo, hi, above, w_above, cap, tl.load(lim_ptr + row)


@jit
def _narrow_kernel(
    s_ptr, smax_ptr, st_ptr, T_ptr, cnt_ptr, mass_ptr, nmin_ptr, lim_ptr, zq_ptr, temp_ptr, topk_ptr, topp_ptr, minp_ptr, V,
    FIRST: tl.constexpr, STAGE: tl.constexpr, NB: tl.constexpr, CAP: tl.constexpr,
):
    # One program a row, after each pass: narrows the band, sets the next thresholds, and
    # empties the sums for the next pass. After the first pass it also sets the row's
    # count cap and weight limit: top-k (and min-p); top-p's share of the weight of all
    # tokens, or of the top k (STAGE 0 found it: zq).
    row = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, NB)
    need, k = _needs(row, V, temp_ptr, topk_ptr, topp_ptr, minp_ptr, STAGE)
    cnt = tl.load(cnt_ptr + row * NB + j)
    mass = tl.load(mass_ptr + row * NB + j)
    tl.store(cnt_ptr + row * NB + j, tl.zeros([NB], dtype=tl.int64))
    tl.store(mass_ptr + row * NB + j, tl.zeros([NB], dtype=tl.int64))
    s0 = tl.load(smax_ptr + row)
    if FIRST:
        lo, hi, T = _first_band(s0, j, k, NB)
        above = 0 * k
        w_above = 0 * k
        top_p = tl.load(topp_ptr + row)
        if STAGE == 0:  # the top k alone, for their weight
            cap = k
            lim = float("inf") + 0.0 * top_p.to(tl.float64)
        else:
            cap = tl.minimum(k, tl.load(nmin_ptr + row))
            z = tl.where((k < V) & (top_p < 1.0), tl.load(zq_ptr + row), _pick_at(mass, j, NB - 1))
            lim = tl.where(top_p < 1.0, top_p.to(tl.float64) * z.to(tl.float64), float("inf"))
        tl.store(nmin_ptr + row, 0 * k)
        tl.store(lim_ptr + row, lim)
        tl.store(st_ptr + row * 8 + _CAP, cap)
        done = (~need).to(tl.int32)
    else:
        lo, hi, above, w_above, cap, lim = _band_state(st_ptr, lim_ptr, row)
        T = tl.load(T_ptr + row * NB + j)
        done = ((tl.load(st_ptr + row * 8 + _DONE) != 0) | ~need).to(tl.int32)
    if done == 0:
        lo, hi, above, w_above, n_band, whole = _narrow(cnt, mass, T, j, lo, hi, above, w_above, cap, lim, NB)
        tl.store(st_ptr + row * 8 + _LO, lo)
        tl.store(st_ptr + row * 8 + _HI, hi)
        tl.store(st_ptr + row * 8 + _ABOVE, above)
        tl.store(st_ptr + row * 8 + _W_ABOVE, w_above)
        tl.store(st_ptr + row * 8 + _N_BAND, n_band.to(tl.int64))
        tl.store(st_ptr + row * 8 + _WHOLE, whole.to(tl.int64))
        tl.store(st_ptr + row * 8 + _DONE, (whole | (n_band <= CAP)).to(tl.int64))
        tl.store(T_ptr + row * NB + j, _next_thresholds(lo, hi, j, NB))
    elif FIRST:
        tl.store(st_ptr + row * 8 + _DONE, 1 + 0 * k)
        tl.store(st_ptr + row * 8 + _WHOLE, 1 + 0 * k)
        tl.store(st_ptr + row * 8 + _LO, 0 * k + KEY_MIN)


@jit
def _gather_kernel(s_ptr, st_ptr, ctr_ptr, scratch_ptr, V, CAP: tl.constexpr, BV: tl.constexpr):
    # The band's tokens (a band of at most CAP) into scratch[row]: each program its own in
    # order, after those of programs that reserved their places first (any order: the
    # keys are sorted next).
    row = tl.program_id(1).to(tl.int64)
    lo = tl.load(st_ptr + row * 8 + _LO)
    hi = tl.load(st_ptr + row * 8 + _HI)
    n_band = tl.load(st_ptr + row * 8 + _N_BAND)
    if (tl.load(st_ptr + row * 8 + _WHOLE) == 0) & (n_band <= CAP):
        _, _, key, inb = _band_chunk(s_ptr, row, V, tl.program_id(0) * BV + tl.arange(0, BV), lo, hi, BV)
        base = tl.atomic_add(ctr_ptr + row, tl.sum(inb.to(tl.int32), 0).to(tl.int64), sem="relaxed")
        _store_band(scratch_ptr, row, base, key, inb, CAP)


@jit
def _walk(key, n, above, w_above, cap, lim, s0, CAP: tl.constexpr):
    """From the band's n keys (CAP,), sorted here: how many the filters keep (a prefix),
    the last kept one, and the weight of every kept token, those above the band too."""
    r = tl.arange(0, CAP)
    key = tl.sort(key, descending=True)
    w = tl.where(r < n, _weight(tl.where(r < n, _value_of_key(key), s0), s0), 0)
    kept = (r < n) & (above + r < cap) & ((w_above + tl.cumsum(w, 0) - w).to(tl.float64) < lim)
    nk = tl.sum(kept.to(tl.int32), 0)  # a prefix
    return nk, tl.sum(tl.where(r == nk - 1, key, 0), 0), w_above + tl.sum(tl.where(kept, w, 0), 0)


@jit
def _select_alone(s_ptr, scratch_ptr, row, V, s0, lo, hi, above, w_above, cap, lim, n_band, NB: tl.constexpr, CAP: tl.constexpr, BV: tl.constexpr):
    """_count_kernel and _narrow_kernel's passes in one program, from where they left the
    band, until at most CAP tokens are left in it; then the gather. Slow (one program
    walks the row each pass): only for bands that the passes left over CAP."""
    j = tl.arange(0, NB)
    whole = n_band < 0
    while (n_band > CAP) & (whole == 0):
        T = _next_thresholds(lo, hi, j, NB)
        cnt = tl.zeros([BV, NB], dtype=tl.int64)  # per thread, summed once a pass
        mass = tl.zeros([BV, NB], dtype=tl.int64)
        for c0 in range(0, V, BV):
            s, m, key, inb = _band_chunk(s_ptr, row, V, c0 + tl.arange(0, BV), lo, hi, BV)
            ge = _above_thresholds(key, inb, T)
            cnt += ge.to(tl.int64)
            mass += tl.where(ge, _weight(s, s0)[:, None], 0)
        lo, hi, above, w_above, n_band, whole = _narrow(tl.sum(cnt, 0), tl.sum(mass, 0), T, j, lo, hi, above, w_above, cap, lim, NB)
    n = 0 * n_band
    for c0 in range(0, V, BV):
        i = c0 + tl.arange(0, BV)
        _, m, key, inb = _band_chunk(s_ptr, row, V, i, lo, hi, BV)
        n += _store_band(scratch_ptr, row, n, key, inb & (whole.to(tl.int32) + tl.zeros_like(i) == 0), CAP)
    return lo, hi, above, w_above, n, whole


@jit
def _resolve_kernel(
    s_ptr, smax_ptr, st_ptr, lim_ptr, ctr_ptr, scratch_ptr, kstar_ptr, zq_ptr, temp_ptr, topk_ptr, topp_ptr, minp_ptr, V,
    STAGE: tl.constexpr, NB: tl.constexpr, CAP: tl.constexpr, BV: tl.constexpr,
):
    # One program a row: K from the gathered band (kstar[row]; KEY_MIN keeps every token),
    # or in STAGE 0 the kept tokens' weight (zq[row]). Empties the gather's counter.
    row = tl.program_id(0).to(tl.int64)
    need, k = _needs(row, V, temp_ptr, topk_ptr, topp_ptr, minp_ptr, STAGE)
    lo, hi, above, w_above, cap, lim = _band_state(st_ptr, lim_ptr, row)
    n_band = tl.load(st_ptr + row * 8 + _N_BAND)
    s0 = tl.load(smax_ptr + row)
    n = tl.load(ctr_ptr + row)
    whole = tl.load(st_ptr + row * 8 + _WHOLE) != 0
    if need & ~whole & (n_band > CAP):  # not narrowed enough
        lo, hi, above, w_above, n, whole = _select_alone(s_ptr, scratch_ptr, row, V, s0, lo, hi, above, w_above, cap, lim, n_band, NB, CAP, BV)
    r = tl.arange(0, CAP)
    band = tl.load(scratch_ptr + row * CAP + r, mask=r < n, other=KEY_MIN)
    nk, last, weight = _walk(band, n, above, w_above, cap, lim, s0, CAP)
    kstar = tl.where(whole, lo, tl.where(nk > 0, last, hi + 1))
    weight = tl.where(whole, w_above, weight)
    if STAGE == 0:
        tl.store(zq_ptr + row, weight)
    else:
        tl.store(kstar_ptr + row, tl.where(need, kstar, KEY_MIN))
    tl.store(ctr_ptr + row, 0 * n)


@jit(do_not_specialize=["B", "S"])
def _finish_kernel(best_ptr, temp_ptr, tok_ptr, step_ptr, seen_ptr, count_ptr, B, S, V, PENALTIES: tl.constexpr,
                   BR: tl.constexpr):
    # token = the sampled one (best's second row, S on) where temperature > 0, else the
    # greedy one; step + 1; the token marked seen; PENALTIES: counted too. BR rows at a
    # time, and B not specialised: one compiled variant serves every batch size
    for r0 in range(0, B, BR):
        rows = r0 + tl.arange(0, BR)
        m = rows < B
        greedy = token_of_key(tl.load(best_ptr + rows, mask=m, other=0))
        sampled = token_of_key(tl.load(best_ptr + S + rows, mask=m, other=0))
        tok = tl.where(tl.load(temp_ptr + rows, mask=m, other=0.0) > 0, sampled, greedy)
        tl.store(tok_ptr + rows, tok, mask=m)
        advance_slots(tok, rows, m, step_ptr, seen_ptr, V, BR)
        if PENALTIES:
            at = count_ptr + rows.to(tl.int64) * V + tok
            tl.store(at, tl.load(at, mask=m, other=0) + 1, mask=m)


def _best(B: int, device) -> torch.Tensor:
    """(2, B) int64 (greedy, sampled) filled with ARGMAX_EMPTY, its rows 16-byte aligned (a row
    of B + B % 2): Triton compiles a variant for each alignment of a pointer it is given, and
    the sampled row's would follow the batch's parity."""
    return torch.full((2, B + B % 2), ARGMAX_EMPTY, device=device, dtype=torch.int64)[:, :B]


def _finish(best: torch.Tensor, p, B: int, V: int, penalties: bool) -> torch.Tensor:
    tokens = torch.empty(B, device=best.device, dtype=torch.int64)
    _finish_kernel[(1,)](best, p.temperature, tokens, p.step, p.seen, p.counts, B, best.stride(0), V,
                         PENALTIES=penalties, BR=64)
    return tokens


def _filter_keys(s: torch.Tensor, smax: torch.Tensor, p, stages, tiles: SamplerTiles) -> torch.Tensor:
    """kstar (B,): each row keeps the tokens whose key is at least kstar[row], found by
    `stages` searches (see _needs): tiles.rounds passes of _count_kernel and _narrow_kernel
    each, then _gather_kernel and _resolve_kernel."""
    B, V = s.shape
    dev = s.device
    NB, CAP, BV = tiles.nb, tiles.cap, tiles.bv
    work = torch.zeros(B * (8 + 3 * NB + 4), device=dev, dtype=torch.int64)  # one memset for all
    st, T, cnt, mass, nmin, zq, ctr, kstar = torch.split(work, [8 * B, NB * B, NB * B, NB * B, B, B, B, B])
    st, T, cnt, mass = st.view(B, 8), T.view(B, NB), cnt.view(B, NB), mass.view(B, NB)
    lim = torch.empty(B, device=dev, dtype=torch.float64)
    scratch = torch.empty(B, CAP, device=dev, dtype=torch.int64)
    params = (p.temperature, p.top_k, p.top_p, p.min_p)
    grid = (triton.cdiv(V, BV), B)
    for stage in stages:
        for r in range(tiles.rounds):
            _count_kernel[grid](s, smax, st, T, cnt, mass, nmin, *params, V, FIRST=r == 0, STAGE=stage, NB=NB, BV=BV)
            _narrow_kernel[(B,)](s, smax, st, T, cnt, mass, nmin, lim, zq, *params, V, FIRST=r == 0, STAGE=stage, NB=NB, CAP=CAP, num_warps=1)
        _gather_kernel[grid](s, st, ctr, scratch, V, CAP=CAP, BV=BV)
        _resolve_kernel[(B,)](s, smax, st, lim, ctr, scratch, kstar, zq, *params, V, STAGE=stage, NB=NB, CAP=CAP, BV=BV, num_warps=8)
    return kstar


def _sample(logits: torch.Tensor, p, stages: tuple, tiles: SamplerTiles, penalties: bool,
            bitmask: torch.Tensor | None) -> torch.Tensor:
    """stages: the filters' searches (see _needs); () for none. penalties: OpenAI's too.
    bitmask: the allowed tokens (module docstring), or None for all."""
    B, V = logits.shape
    x = logits.float().contiguous()
    best = _best(B, x.device)  # greedy, sampled
    smax = torch.full((B,), float("-inf"), device=x.device)
    s = torch.empty_like(x)
    grid = (triton.cdiv(V, tiles.bv), B)
    # (without fused multiply-adds: the penalties round as sampling.penalize's separate steps)
    fusion = {"enable_fp_fusion": False} if penalties else {}
    _scale_kernel[grid](x, p.seen, p.repetition_penalty, p.temperature, s, best, smax, p.logit_bias, p.counts,
                        p.presence_penalty, p.frequency_penalty, _words(bitmask, B, V, x), V, PENALTIES=penalties,
                        MASKED=bitmask is not None, BV=tiles.bv, **fusion)
    kstar = _filter_keys(s, smax, p, stages, tiles) if stages else s  # s: unused
    _pick_kernel[grid](s, p.seed, p.step, kstar, best[1], V, FILTERED=bool(stages), BV=tiles.bv)
    return _finish(best, p, B, V, penalties)


def _words(bitmask: torch.Tensor | None, B: int, V: int, dummy: torch.Tensor) -> torch.Tensor:
    """A launch's bitmask argument: the bitmask, checked; `dummy` (never read) without one."""
    if bitmask is None:
        return dummy
    if bitmask.shape != (B, triton.cdiv(V, 32)) or bitmask.dtype != torch.int32 or bitmask.device != dummy.device:
        raise ValueError(f"a bitmask of {V} tokens' {B} rows is int32 ({B}, {triton.cdiv(V, 32)}) on "
                         f"{dummy.device}, not {bitmask.dtype} {tuple(bitmask.shape)} on {bitmask.device}")
    return bitmask.contiguous()


def sample_filtered(logits: torch.Tensor, p, tiles: SamplerTiles, penalties: bool = False,
                    bitmask: torch.Tensor | None = None) -> torch.Tensor:
    """sampling.sample for any slots (penalties: sampling.sample_penalized): the same
    tokens, steps, seen marks (and counts). tiles: the kernels' launch settings; bitmask:
    each row's allowed tokens, None for all (as in the samplers below)."""
    return _sample(logits, p, (0, 1), tiles, penalties, bitmask)


def sample_filtered_apart(logits: torch.Tensor, p, tiles: SamplerTiles, penalties: bool = False,
                          bitmask: torch.Tensor | None = None) -> torch.Tensor:
    """sample_filtered for slots none of which uses top-k and top-p together (one search
    for the kept tokens, not two)."""
    return _sample(logits, p, (1,), tiles, penalties, bitmask)


def sample_temperature(logits: torch.Tensor, p, tiles: SamplerTiles, penalties: bool = False,
                       bitmask: torch.Tensor | None = None) -> torch.Tensor:
    """sampling.sample (penalties: sample_penalized) for slots that use no top-k, top-p or
    min-p (repetition penalty and temperature, greedy where the temperature is 0): no
    search for the kept tokens."""
    return _sample(logits, p, (), tiles, penalties, bitmask)


def sample_greedy(logits: torch.Tensor, p, tiles: SamplerTiles, bitmask: torch.Tensor | None = None) -> torch.Tensor:
    """sampling.sample_greedy (every slot greedy, no repetition penalty) in one pass over
    the logits and the bitmask: for greedy batches with a guided row, whose argmax of a
    masked copy would read the logits twice more."""
    B, V = logits.shape
    x = logits.contiguous()
    best = _best(B, x.device)  # (greedy: best[0] alone)
    _greedy_kernel[(triton.cdiv(V, tiles.bv), B)](x, _words(bitmask, B, V, x), best, V, MASKED=bitmask is not None,
                                                  BV=tiles.bv)
    return _finish(best, p, B, V, False)
