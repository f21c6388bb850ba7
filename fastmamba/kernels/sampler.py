"""Sampling on the GPU in a few Triton kernels: the same tokens as sampling.sample, faster.

sampling.sample (the oracle, and the CPU path) is ~85 small torch kernels a step: 266 µs at
batch 1 and 2 ms at batch 128 on an H200 (benchmarks/sampling_speed.py), more than the
whole 130m decode step. Here the element-wise work is three kernels:

    _scale_kernel   repetition penalty, each row's greedy argmax, logits / temperature
    (torch)         only with top-k / top-p / min-p: the stable sort and, as in `sample`,
                    the top-k softmax and its cumulative sum (the same torch calls, so the
                    same bits)
    _pick_kernel    the filters, Gumbel noise from the same counter-based hash, each row's
                    argmax of the kept tokens' scaled logits + noise
    _finish_kernel  greedy or sampled token per row; step + 1; the token marked seen

The argmaxes are atomic maxima over int64 keys that order as (value, lower index) do
(decode_step._argmax_keys), so the order of programs cannot change a token.
`sample_temperature` serves rows without filters (no sort at all); `sample_filtered` any
row. Both take and update SlotParams exactly as `sample` does.
"""

from __future__ import annotations

import torch

from ._triton import INTERPRET, jit, tl, triton
from .decode_step import ARGMAX_EMPTY, _argmax_keys

BV = 1024  # tokens a program
_LOW32 = tl.constexpr(2**32 - 1)


@jit
def _hash32(x):
    """sampling.hash32 on int64 tensors (values below 2^32 in, below 2^32 out)."""
    x = x & _LOW32
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _LOW32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _LOW32
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
    u = ((h >> 8).to(tl.float32) + 0.5) * (1.0 / (1 << 24))
    return -_log(-_log(u))


@jit
def _scale_kernel(logits_ptr, seen_ptr, pen_ptr, temp_ptr, s_ptr, best_ptr, V, BV: tl.constexpr):
    # s = penalised logits / temperature; each row's greedy key into best[row]
    row = tl.program_id(1).to(tl.int64)
    i = tl.program_id(0) * BV + tl.arange(0, BV)
    m = i < V
    x = tl.load(logits_ptr + row * V + i, mask=m, other=0.0)
    pen = tl.load(pen_ptr + row)
    seen = tl.load(seen_ptr + row * V + i, mask=m, other=0) != 0
    x = tl.where(seen, tl.where(x > 0, x / pen, x * pen), x)
    tl.atomic_max(best_ptr + row, tl.max(_argmax_keys(x[None, :], i, m), axis=None), sem="relaxed")
    t = tl.maximum(tl.load(temp_ptr + row), 1e-6)
    tl.store(s_ptr + row * V + i, x / t, mask=m)


@jit
def _pick_kernel(
    s_ptr, order_ptr, mb_ptr, seed_ptr, step_ptr, topk_ptr, topp_ptr, minp_ptr, best_ptr, V,
    FILTERED: tl.constexpr, BV: tl.constexpr,
):
    # FILTERED: position r of the row's sorted order (s sorted, order = token ids, mb = the
    # probability mass ranked before r) is kept by top-k, top-p and min-p as in `sample`;
    # otherwise every token is kept and s is in token order. Each row's best kept
    # s + Gumbel noise goes into best[row].
    row = tl.program_id(1).to(tl.int64)
    r = tl.program_id(0) * BV + tl.arange(0, BV)
    m = r < V
    s = tl.load(s_ptr + row * V + r, mask=m, other=0.0)
    if FILTERED:
        ids = tl.load(order_ptr + row * V + r, mask=m, other=0)
        k = tl.load(topk_ptr + row)
        k = tl.where(k > 0, tl.minimum(k, V), V)
        top_p = tl.load(topp_ptr + row)
        min_p = tl.load(minp_ptr + row)
        mb = tl.load(mb_ptr + row * V + r, mask=m, other=0.0)
        s0 = tl.load(s_ptr + row * V)
        zero = tl.zeros_like(s)  # scalar conditions as tensors (the interpreter wants them so)
        keep = (r < k) & ((zero + top_p >= 1.0) | (mb < top_p))
        keep &= (zero + min_p == 0.0) | (s - s0 >= _log(tl.maximum(min_p, 1e-30)))
        keep = (keep | (r == 0)) & m
    else:
        ids = r.to(tl.int64)
        keep = m
    v = s + _gumbel(tl.load(seed_ptr + row), tl.load(step_ptr + row), ids)
    tl.atomic_max(best_ptr + row, tl.max(_argmax_keys(v[None, :], ids, keep), axis=None), sem="relaxed")


@jit
def _finish_kernel(best_ptr, temp_ptr, tok_ptr, step_ptr, seen_ptr, B, V, BR: tl.constexpr):
    # token = the sampled one where temperature > 0, else the greedy one; step + 1; the
    # token marked seen
    rows = tl.arange(0, BR)
    m = rows < B
    greedy = _LOW32 - (tl.load(best_ptr + rows, mask=m, other=0) & _LOW32)
    sampled = _LOW32 - (tl.load(best_ptr + B + rows, mask=m, other=0) & _LOW32)
    tok = tl.where(tl.load(temp_ptr + rows, mask=m, other=0.0) > 0, sampled, greedy)
    tl.store(tok_ptr + rows, tok, mask=m)
    tl.store(step_ptr + rows, tl.load(step_ptr + rows, mask=m, other=0) + 1, mask=m)
    tl.store(seen_ptr + rows.to(tl.int64) * V + tok, tl.full([BR], 1, tl.int1), mask=m)


def _sample(logits: torch.Tensor, p, filtered: bool) -> torch.Tensor:
    B, V = logits.shape
    x = logits.float().contiguous()
    best = torch.full((2, B), ARGMAX_EMPTY, device=x.device, dtype=torch.int64)  # greedy, sampled
    s = torch.empty_like(x)
    grid = (triton.cdiv(V, BV), B)
    _scale_kernel[grid](x, p.seen, p.repetition_penalty, p.temperature, s, best, V, BV=BV)
    order = mass_before = s  # unused unless filtered
    if filtered:  # as in sampling.sample, call for call
        s, order = s.sort(dim=-1, descending=True, stable=True)
        rank = torch.arange(V, device=x.device)[None, :]
        k = torch.where(p.top_k > 0, p.top_k.clamp(max=V), V)[:, None]
        probs = torch.softmax(s.masked_fill(rank >= k, float("-inf")), dim=-1)
        mass_before = probs.cumsum(-1) - probs
    _pick_kernel[grid](
        s, order, mass_before, p.seed, p.step, p.top_k, p.top_p, p.min_p, best[1], V, FILTERED=filtered, BV=BV
    )
    tokens = torch.empty(B, device=x.device, dtype=torch.int64)
    _finish_kernel[(1,)](best, p.temperature, tokens, p.step, p.seen, B, V, BR=triton.next_power_of_2(B))
    return tokens


def sample_filtered(logits: torch.Tensor, p) -> torch.Tensor:
    """sampling.sample for any slots: the same tokens, steps and seen marks."""
    return _sample(logits, p, True)


def sample_temperature(logits: torch.Tensor, p) -> torch.Tensor:
    """sampling.sample for slots that use no top-k, top-p or min-p (repetition penalty and
    temperature, greedy where the temperature is 0): no sort at all."""
    return _sample(logits, p, False)
