"""A GPU server's start, so that no request waits for a Triton kernel to compile: a token
drawn with each kind of sampler (a server samples eagerly, outside its decode graphs), and
for an eager prefill (a hybrid's) prompts of each kind of length through the engine core's
own steps (EngineCore.capture_prefill_graphs calls them)."""

from __future__ import annotations

import torch

from fastmamba.core.sampling import SlotParams, pick_sampler
from fastmamba.core.sampling_params import SamplingParams
from fastmamba.engine import protocol
from fastmamba.engine.plan import SAMPLER_TILES
from fastmamba.engine.prefix_cache import PrefixCache
from fastmamba.engine.protocol import Failed

# a request of each of the GPU samplers' kinds (sampling.pick_sampler): temperature alone,
# one filter, top-k with top-p, penalties
SAMPLER_KINDS = (SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, top_k=8),
                 SamplingParams(temperature=1.0, top_k=8, top_p=0.9), SamplingParams(temperature=1.0, presence_penalty=0.5))


def warm_up_samplers(core) -> None:
    """Draws a token for a scratch slot with each kind of sampler, with and without a
    bitmask (structured output), so that no request waits for a sampler's kernels to
    compile: a server samples eagerly, outside its decode graphs, and Triton compiles a
    sampler's launches at their first call (Granite-4.0-H-Tiny served at 64 streams, H100:
    the first sampled requests met 12 compiles, and the served throughput was 0.85 of
    offline where a run with them compiled beforehand gave 1.06)."""
    V = core.model.config.vocab_size
    logits = torch.zeros(1, V, device=core.device)
    everything = torch.full((1, -(-V // 32)), -1, dtype=torch.int32, device=core.device)  # (every token allowed)
    for params in SAMPLER_KINDS:
        for bitmask in (None, everything):
            slot = SlotParams.empty(1, V, core.device)
            slot.set_slots([(params, 0, [])])
            pick_sampler([params], core.gpu, SAMPLER_TILES)(logits, slot, bitmask=bitmask)


def warm_up_prefill(core) -> None:
    """Runs prompts of each kind of length through the engine core's own steps and forgets
    them, so that no request waits for a Triton kernel to compile. An eager prefill (a
    hybrid's) compiles a kernel variant at the first prompt of each kind: the SSD's chunk
    tile follows a short chunk's length up to its size, Triton specialises lengths
    divisible by 16 (and 1) and so a batch's strides, T times a width, by the powers of
    two in T; a batch's left padding and a continued state are variants of their own
    (a tiny Nemotron-H's serve-like workload met 32 variants; Nemotron-H-8B served at 64
    streams without this, H100: first tokens at a p50 of 7.9 s). Lengths 1, 2, 3, 4, 8,
    and each power of two p from 16 to the cache's interval and p + 1, 2, 4, 8 (each
    chunk tile with T odd or divisible by 2, 4, 8, 16): alone, two at a time, and after a
    first chunk of the interval; then the powers of two up to the prefill budget."""
    powers = [16 << k for k in range((core.cache.interval // 16).bit_length())]  # 16 .. interval
    short = [1, 2, 3, 4, 8] + [p + d for p in powers for d in (0, 1, 2, 4, 8)]
    kinds = ([[n] for n in short] + [[n, max(1, n - 3)] for n in short]
             + [[core.cache.interval + n] for n in short]
             + [[p] for p in (core.cache.interval << k for k in range(1, 8)) if p <= core.prefill_tokens])
    kv = core.pool.kv
    longest = None if kv is None or kv.growable else kv.request_blocks * kv.block_size
    V, rid, new_tokens = core.model.config.vocab_size, -1, 2
    for lengths in kinds:
        for n in lengths:
            if longest is not None and n + new_tokens > longest:
                continue
            # (a first token of its own: no prompt is a prefix of another, none hits the cache)
            ids = [(-rid + 7 * i) % (V - 1) + 1 for i in range(n)]
            core.add(protocol.Request(rid, ids, SamplingParams(max_tokens=new_tokens, stop_token_ids=[])))
            rid -= 1
        while core.has_work:
            for out in core.step():
                if isinstance(out, Failed):  # (an engine that cannot prefill should not start)
                    raise RuntimeError(f"the prefill warm-up's prompts of {lengths} tokens failed: "
                                       f"{out.error.kind}: {out.error.message}")
    core.cache = PrefixCache(core.cache.budget, core.cache.interval)
    core.cache_queries = core.cache_hits = 0
