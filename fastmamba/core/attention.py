"""The attention sublayer of the hybrids (Nemotron-H, Bamba, Granite-4.0-H, Falcon-H1) over
`Ops`, with its keys and values in a paged KV cache (kv_cache.py).

Per sublayer, for a slot's new tokens at positions p (its context so far, then on):
```
q, k, v = qkv_proj(u)                                  # H query heads, KVH key/value heads (GQA): one product
q, k    = rope(q, p), rope(k, p)                       # the leading rotary_dim dims of a head; none for NoPE
cache[p] = k, v                                        # in the storage dtype
y       = softmax(q k^T * scale, over positions <= p) v # float32: scores, max, sum
out     = o_proj(y)
```
Left padding (`start`) is no token: it is not stored, and its outputs are zero. The model's
q_proj, k_proj and v_proj are one matrix here (their rows in that order), one product.
A decode step on the GPU runs the rotation, the store and the attention in the three launches
of kernels/paged_attention.decode_attention (`Ops.decode_attention`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from fastmamba.core import fp8
from fastmamba.core.kv_cache import KVCache
from fastmamba.kernels.paged_attention import rope_ref, store_ref


@dataclass
class AttentionWeights:
    norm_w: torch.Tensor  # (d,) f32
    qkv_w: torch.Tensor  # ((H + 2 KVH) hd, d) storage dtype: q_proj's rows, k_proj's, v_proj's
    o_w: torch.Tensor  # (d, H hd)
    qkv_b: torch.Tensor | None = None  # f32
    o_b: torch.Tensor | None = None


def shapes(c, norm: str, p: str) -> dict[str, tuple[int, ...]]:
    """The sublayer's tensors (its norm's name, its projections under prefix p) and their shapes."""
    d, H, KVH, hd = c.d_model, c.attn_heads, c.kv_heads, c.attn_head_dim
    out = {norm: (d,), p + "q_proj.weight": (H * hd, d), p + "k_proj.weight": (KVH * hd, d),
           p + "v_proj.weight": (KVH * hd, d), p + "o_proj.weight": (d, H * hd)}
    if c.attn_bias:
        out.update({p + "q_proj.bias": (H * hd,), p + "k_proj.bias": (KVH * hd,), p + "v_proj.bias": (KVH * hd,),
                    p + "o_proj.bias": (d,)})
    return out


def layer_weights(norm: str, p: str, big, small) -> AttentionWeights:
    """The sublayer's weights: `big(name)` in the storage dtype, `small(name)` in float32 (None
    where absent); q_proj, k_proj and v_proj stacked by rows (their biases too)."""
    names = [p + n for n in ("q_proj", "k_proj", "v_proj")]
    biases = [small(n + ".bias") for n in names]
    return AttentionWeights(
        norm_w=small(norm), qkv_w=fp8.cat_rows([big(n + ".weight") for n in names]), o_w=big(p + "o_proj.weight"),
        qkv_b=None if biases[0] is None else torch.cat(biases), o_b=small(p + "o_proj.bias"),
    )


# the fused attention's backends for prefill: every one torch has but cuDNN's (see attention())
PREFILL_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def attention(c, lw: AttentionWeights, u: torch.Tensor, kv: KVCache, layer: int, rows: torch.Tensor, ops,
              start: torch.Tensor | None = None, blocks: int = 0) -> torch.Tensor:
    """One attention sublayer over T new tokens of `rows` (B,) of the cache (their blocks
    reserved): u (B, T, d) -> (B, T, d) f32; stores the tokens' keys and values (the caller
    advances the cache's lengths once the whole pass has run). start (B,): left padding.
    blocks: the blocks the rows' contexts span after the pass, at most (0: the table's width):
    the keys read, whatever a row reserved beyond."""
    B, T, _ = u.shape
    H, KVH, hd = c.attn_heads, c.kv_heads, c.attn_head_dim
    qkv = ops.linear(u, lw.qkv_w, lw.qkv_b)  # (B, T, (H + 2 KVH) hd) f32
    scale = c.attn_scale or hd**-0.5
    if T == 1 and start is None and ops.decode_attention is not None:  # a decode step: three kernels
        y = ops.decode_attention(qkv.view(B, -1), kv.k[layer], kv.v[layer], kv.table, kv.lengths, rows, H, scale,
                                 c.rope_theta, c.rotary_dim)
        return ops.linear(y.view(B, 1, H * hd), lw.o_w, lw.o_b)
    q, k, v = (t.view(B, T, n, hd) for t, n in zip(qkv.split([H * hd, KVH * hd, KVH * hd], dim=-1), (H, KVH, KVH)))
    steps = torch.arange(T, device=u.device)
    rel = steps[None, :] - (start.to(u.device, torch.int64)[:, None] if start is not None else 0)
    valid = rel >= 0  # (B, T): not left padding
    pos = kv.lengths[rows][:, None] + rel.clamp(min=0)  # (B, T)
    if c.rope_theta:
        q, k = rope_ref(q, pos, c.rope_theta, c.rotary_dim), rope_ref(k, pos, c.rope_theta, c.rotary_dim)
    width = blocks or kv.table.shape[1]
    store_ref(kv.k[layer], kv.v[layer], kv.table, rows, pos, k, v, valid, width)
    table = kv.table[rows, :width]  # (B, W)
    # (16-bit caches: the products' operands in their dtype, the query rounded once as DESIGN
    # §4 has it, so that the fused attention runs on 16-bit inputs: a float32 copy of every
    # context's keys and values, and float32 products, cost the prefill more than the rest
    # of the sublayer)
    keys = kv.k[layer][table].flatten(1, 2)  # (B, S, KVH, hd)
    values = kv.v[layer][table].flatten(1, 2)
    q = q.to(keys.dtype)
    seen = torch.arange(keys.shape[1], device=u.device)[None, None, :] <= pos[:, :, None]  # (B, T, S)
    seen = seen | ~valid[:, :, None]  # (padding's rows attend anywhere: finite, then zeroed)
    # torch's fused attention: the scores are never held whole, so a long prompt's chunk of T
    # tokens over S of context costs O(T + S) memory, not the (B, H, T, S) float32 scores of a
    # plain softmax. Query head h reads key-value head h // (H / KVH), repeated here rather
    # than through enable_gqa: with float32 inputs and a mask, only torch's math backend takes
    # enable_gqa, and it holds those scores (32 GiB for an 8192-token chunk over 32768 tokens
    # at Nemotron-H-8B's 32 heads, on an H100), while the memory-efficient one takes these.
    if H != KVH:
        keys, values = keys.repeat_interleave(H // KVH, dim=2), values.repeat_interleave(H // KVH, dim=2)
    # Not cuDNN's backend: it builds a plan for each new shape, and a server's chunks rarely
    # repeat one (H100, a first step of 8 x 512-token chunks: 1.2 s with it, 0.12 s without;
    # benchmarks/hybrid.py --serve-steps)
    with sdpa_kernel(PREFILL_BACKENDS):
        y = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2), attn_mask=seen[:, None], scale=scale)
    y = torch.where(valid[:, :, None], y.transpose(1, 2).reshape(B, T, H * hd).float(), 0.0)
    return ops.linear(y, lw.o_w, lw.o_b)
