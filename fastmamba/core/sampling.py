"""Next-token sampling done entirely in device tensors.

Every slot (batch row) carries its own parameters and its own random stream, so a slot
samples the same tokens whether it runs alone or beside others, and the sampler has fixed
shapes (it can sit inside a CUDA graph). The random numbers come from a counter-based hash
of (seed, step, token id), not from a torch.Generator: no generator state to capture, and
the same uniforms on every device.

Structured output holds a row to the tokens its grammar allows: every sampler takes an
optional bitmask, xgrammar's int32 (B, ceil(V/32)) with bit j % 32 of word j // 32 set where
token j is allowed, and reads a forbidden token's logit as -inf (`allowed`, `masked`). A row
allows at least one token.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from functools import cache, partial, update_wrapper
from typing import TYPE_CHECKING

import torch

from fastmamba.core.sampling_params import MASK32, SamplingParams
from fastmamba.core.transfer import to_device

if TYPE_CHECKING:
    from fastmamba.kernels.sampler import SamplerTiles


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """x * c mod 2**32 for int64 x in [0, 2**32), without ever overflowing int64."""
    lo = x * (c & 0xFFFF)
    hi = ((x * (c >> 16)) & 0xFFFF) << 16
    return (lo + hi) & MASK32


def hash32(x: torch.Tensor) -> torch.Tensor:
    """A well-mixed 32-bit integer hash (xorshift-multiply), elementwise on int64 tensors."""
    x = x & MASK32
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


UNIFORM_MAX = 1.0 - 2.0**-24  # the largest float32 below 1


def uniforms(seed: torch.Tensor, step: torch.Tensor, vocab: int) -> torch.Tensor:
    """(B, V) uniforms in (0, 1), a pure function of each slot's (seed, step) and the token id."""
    key = hash32(seed * 0x9E37 + hash32(step))  # (B,)
    ids = torch.arange(vocab, device=seed.device, dtype=torch.int64)
    return unit_floats(hash32(key[:, None] ^ hash32(ids + 0x632BE5AB)[None, :]))  # (B, V)


def unit_floats(h: torch.Tensor) -> torch.Tensor:
    """32-bit hashes as float32 uniforms in (0, 1): their top 24 bits, centred. (h >> 8) + 0.5
    needs 25 bits: at 2^24 - 1 float32 rounds it up to 2^24, a uniform of exactly 1, whose
    Gumbel key is +inf, and NaN beside a masked -inf logit, which argmax then picks: a
    guided request drew a token its grammar forbids, about once in 4000 steps of a
    4096-token vocabulary. Held below 1."""
    return (((h >> 8).float() + 0.5) * (1.0 / (1 << 24))).clamp_max(UNIFORM_MAX)


@dataclass
class SlotParams:
    """The sampling parameters of every slot, as device tensors of fixed shape."""

    temperature: torch.Tensor  # (B,) f32
    top_k: torch.Tensor  # (B,) int64
    top_p: torch.Tensor  # (B,) f32
    min_p: torch.Tensor  # (B,) f32
    repetition_penalty: torch.Tensor  # (B,) f32
    seed: torch.Tensor  # (B,) int64
    step: torch.Tensor  # (B,) int64, tokens sampled so far
    seen: torch.Tensor  # (B, V) bool, prompt and generated tokens (for the repetition penalty)
    presence_penalty: torch.Tensor  # (B,) f32
    frequency_penalty: torch.Tensor  # (B,) f32
    logit_bias: torch.Tensor  # (B, V) f32, dense: a fixed shape whatever the request's entries
    # (B, V) int32, each token's count in the slot's output so far, for the presence and
    # frequency penalties: kept by the samplers that apply them (pick_sampler), which every
    # token of a slot that uses them goes through
    counts: torch.Tensor

    @classmethod
    def empty(cls, batch: int, vocab: int, device) -> "SlotParams":
        def full(value, dtype=torch.float32):
            return torch.full((batch,), value, dtype=dtype, device=device)

        return cls(
            temperature=full(0.0),
            top_k=full(0, torch.int64),
            top_p=full(1.0),
            min_p=full(0.0),
            repetition_penalty=full(1.0),
            seed=full(0, torch.int64),
            step=full(0, torch.int64),
            seen=torch.zeros(batch, vocab, dtype=torch.bool, device=device),
            presence_penalty=full(0.0),
            frequency_penalty=full(0.0),
            logit_bias=torch.zeros(batch, vocab, dtype=torch.float32, device=device),
            counts=torch.zeros(batch, vocab, dtype=torch.int32, device=device),
        )

    def rows(self, start: int, stop: int) -> "SlotParams":
        """Slots start..stop-1 as views: sampling through them updates these slots."""
        return SlotParams(**{f.name: getattr(self, f.name)[start:stop] for f in fields(self)})

    def set_slots(self, requests) -> None:
        """Configures slots 0, 1, ... from (params, seed, prompt_ids) per request."""
        for i, (params, seed, prompt_ids) in enumerate(requests):
            self.set_slot(i, params, seed, prompt_ids)

    def set_slot(self, slot: int, params: SamplingParams, seed: int, prompt_ids: list[int]) -> None:
        self.temperature[slot] = params.temperature
        self.top_k[slot] = params.top_k
        self.top_p[slot] = params.top_p
        self.min_p[slot] = params.min_p
        self.repetition_penalty[slot] = params.repetition_penalty
        self.seed[slot] = seed
        self.step[slot] = 0
        self.seen[slot] = False
        if not isinstance(prompt_ids, torch.Tensor):
            prompt_ids = torch.tensor(prompt_ids, dtype=torch.int64, device=self.seen.device)
        self.seen[slot, prompt_ids] = True
        self.presence_penalty[slot] = params.presence_penalty
        self.frequency_penalty[slot] = params.frequency_penalty
        self.logit_bias[slot] = 0.0
        self.counts[slot] = 0
        if params.logit_bias:
            V = self.logit_bias.shape[1]
            if max(params.logit_bias) >= V:
                raise ValueError(f"SamplingParams.logit_bias holds token id {max(params.logit_bias)}, outside the "
                                 f"vocabulary [0, {V})")
            ids = to_device(list(params.logit_bias), self.logit_bias.device)
            bias = to_device(list(params.logit_bias.values()), self.logit_bias.device, torch.float32)
            self.logit_bias[slot, ids] = bias


def allowed(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """A bitmask (B, ceil(V/32)) int32 unpacked: (B, V) bool, True where the token is allowed."""
    ids = torch.arange(vocab, device=bitmask.device)
    return ((bitmask[:, ids >> 5] >> (ids & 31).to(torch.int32)) & 1) != 0


def masked(logits: torch.Tensor, bitmask: torch.Tensor | None) -> torch.Tensor:
    """logits (B, V) with the tokens `bitmask` forbids at -inf (a copy); logits itself
    without a bitmask."""
    if bitmask is None:
        return logits
    return logits.masked_fill(~allowed(bitmask, logits.shape[-1]), float("-inf"))


def penalize(logits: torch.Tensor, p: SlotParams) -> torch.Tensor:
    """OpenAI's logit bias, presence and frequency penalties on raw logits (B, V):
    logits + bias - presence * (count > 0) - frequency * count, in float32, in that order
    (the Triton samplers round each step alike)."""
    x = logits.float() + p.logit_bias
    x = x - torch.where(p.counts > 0, p.presence_penalty[:, None], 0.0)
    return x - p.frequency_penalty[:, None] * p.counts.float()


def count_tokens(token: torch.Tensor, p: SlotParams) -> None:
    """Each slot's new token (B,) counted in its output's counts."""
    p.counts.scatter_add_(1, token[:, None], torch.ones_like(token[:, None], dtype=torch.int32))


def sample(logits: torch.Tensor, p: SlotParams, bitmask: torch.Tensor | None = None) -> torch.Tensor:
    """Next token of every slot from its logits (B, V); advances each slot's step and history.

    Order as in HF: repetition penalty, temperature, top-k, top-p, min-p; then a Gumbel-max
    draw, which picks token i with probability softmax(kept logits / temperature)_i.
    A temperature of 0 is greedy (argmax after the repetition penalty). bitmask: the
    tokens each row may draw (module docstring), None for all.
    """
    x = masked(logits.float(), bitmask)  # (B, V)
    V = x.shape[-1]
    pen = p.repetition_penalty[:, None]
    x = torch.where(p.seen, torch.where(x > 0, x / pen, x * pen), x)
    greedy = x.argmax(-1)  # (B,)

    x = x / p.temperature.clamp_min(1e-6)[:, None]
    sorted_x, order = x.sort(dim=-1, descending=True, stable=True)  # (B, V)
    rank = torch.arange(V, device=x.device)[None, :]
    k = torch.where(p.top_k > 0, p.top_k.clamp(max=V), V)[:, None]
    in_top_k = rank < k
    probs = torch.softmax(sorted_x.masked_fill(~in_top_k, float("-inf")), dim=-1)
    mass_before = probs.cumsum(-1) - probs  # probability of all higher-ranked tokens
    # top_p = 1 keeps every token (the float sum may reach 1 before the last one)
    in_top_p = (p.top_p[:, None] >= 1) | (mass_before < p.top_p[:, None])
    # min-p keeps tokens whose probability is at least min_p times the top one's.
    min_p = p.min_p[:, None]
    in_min_p = (min_p == 0) | (sorted_x - sorted_x[:, :1] >= torch.log(min_p.clamp_min(1e-30)))
    keep_sorted = in_top_k & in_top_p & in_min_p
    keep_sorted[:, 0] = True  # the most likely token always survives
    keep = torch.zeros_like(keep_sorted).scatter(1, order, keep_sorted)

    gumbel = -torch.log(-torch.log(uniforms(p.seed, p.step, V)))  # (B, V)
    sampled = (x.masked_fill(~keep, float("-inf")) + gumbel).argmax(-1)
    token = torch.where(p.temperature > 0, sampled, greedy)

    p.step += 1
    p.seen.scatter_(1, token[:, None], True)
    return token


def sample_penalized(logits: torch.Tensor, p: SlotParams, bitmask: torch.Tensor | None = None) -> torch.Tensor:
    """`sample` after OpenAI's logit bias and presence and frequency penalties (`penalize`,
    on the raw logits, as vLLM orders them); counts each slot's token. (A forbidden token's
    -inf stays -inf through them: masking before or after is one.)"""
    token = sample(penalize(logits, p), p, bitmask)
    count_tokens(token, p)
    return token


def pick_sampler(params: list[SamplingParams], gpu_kernels: bool, tiles: SamplerTiles):
    """The sampler for a batch of requests, called as sampler(logits, p[, bitmask=...]):
    the argmax alone where every request is greedy without a repetition penalty (for the
    GPU engine, where a request is guided, the Triton one that reads the bitmask beside the
    logits); for the GPU engine (gpu_kernels), the Triton samplers
    (kernels/sampler.py: the same tokens as `sample`; the filters' search only where a
    request uses top-k, top-p or min-p, twice where one uses top-k with top-p), launched
    with `tiles`; otherwise `sample`, pure PyTorch. Where a request uses OpenAI's logit
    bias or presence or frequency penalty (SamplingParams.penalized), never the argmax
    alone, and the sampler that applies them and counts the tokens (`sample_penalized`, or
    the Triton sampler with penalties=True): every token of such a request is drawn by one,
    so its counts are whole; other batches pay nothing for them. The same sampler and tiles
    give the same object each call (the CUDA graphs are captured once per sampler)."""
    penalized = any(p.penalized for p in params)
    greedy = not penalized and all(p.temperature == 0 and p.repetition_penalty == 1 for p in params)
    if greedy and not (gpu_kernels and any(p.guide is not None for p in params)):
        return sample_greedy
    from fastmamba.kernels._triton import HAVE_TRITON

    if greedy:
        if not HAVE_TRITON:
            return sample_greedy
        from fastmamba.kernels import sampler

        return _with_tiles(sampler.sample_greedy, tiles)
    if gpu_kernels and HAVE_TRITON:
        from fastmamba.kernels import sampler

        if any(p.top_k and p.top_p < 1 for p in params):
            return _with_tiles(sampler.sample_filtered, tiles, penalized)
        if any(p.top_k or p.top_p < 1 or p.min_p for p in params):
            return _with_tiles(sampler.sample_filtered_apart, tiles, penalized)
        return _with_tiles(sampler.sample_temperature, tiles, penalized)
    return sample_penalized if penalized else sample


@cache
def _with_tiles(sampler, tiles: SamplerTiles, penalties: bool = False):
    """sampler(logits, p, tiles[, penalties=True]) as sampler(logits, p), under the
    sampler's name: one object per sampler, tiles and penalties."""
    return update_wrapper(partial(sampler, tiles=tiles, **({"penalties": True} if penalties else {})), sampler)


def sample_greedy(logits: torch.Tensor, p: SlotParams, bitmask: torch.Tensor | None = None) -> torch.Tensor:
    """`sample` for slots that are all greedy with no repetition penalty: argmax alone (of
    the allowed tokens, with a bitmask)."""
    token = masked(logits, bitmask).argmax(-1)
    p.step += 1
    p.seen.scatter_(1, token[:, None], True)
    return token
