"""The attention sublayer of the hybrids (Nemotron-H, Bamba, Granite-4.0-H, Falcon-H1) over
`Ops`, with its keys and values in a paged KV cache (kv_cache.py).

Per sublayer, for a slot's new tokens at positions p (its context so far, then on):
```
q, k, v = q_proj(u), k_proj(u), v_proj(u)              # H query heads, KVH key/value heads (GQA)
q, k    = rope(q, p), rope(k, p)                       # the leading rotary_dim dims of a head; none for NoPE
cache[p] = k, v                                        # in the storage dtype
y       = softmax(q k^T * scale, over positions <= p) v # float32: scores, max, sum
out     = o_proj(y)
```
Left padding (`start`) is no token: it is not stored, and its outputs are zero.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fastmamba.core.kv_cache import KVCache


@dataclass
class AttentionWeights:
    norm_w: torch.Tensor  # (d,) f32
    q_w: torch.Tensor  # (H hd, d) storage dtype
    k_w: torch.Tensor  # (KVH hd, d)
    v_w: torch.Tensor  # (KVH hd, d)
    o_w: torch.Tensor  # (d, H hd)
    q_b: torch.Tensor | None = None  # f32
    k_b: torch.Tensor | None = None
    v_b: torch.Tensor | None = None
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
    """The sublayer's weights: `big(name)` in the storage dtype, `small(name)` in float32 (None where absent)."""
    return AttentionWeights(
        norm_w=small(norm), q_w=big(p + "q_proj.weight"), k_w=big(p + "k_proj.weight"), v_w=big(p + "v_proj.weight"),
        o_w=big(p + "o_proj.weight"), q_b=small(p + "q_proj.bias"), k_b=small(p + "k_proj.bias"),
        v_b=small(p + "v_proj.bias"), o_b=small(p + "o_proj.bias"),
    )


def rope(x: torch.Tensor, pos: torch.Tensor, theta: float, rotary_dim: int) -> torch.Tensor:
    """x (B, T, heads, hd) f32 rotated at positions pos (B, T): each pair (i, i + rd/2) of the
    first rd dims by pos * theta^(-2i / rd) (transformers' rotate_half layout)."""
    rd = rotary_dim
    inv = 1.0 / theta ** (torch.arange(0, rd, 2, dtype=torch.float32, device=x.device) / rd)
    freqs = pos[..., None].float() * inv  # (B, T, rd / 2)
    emb = torch.cat([freqs, freqs], -1)[:, :, None]  # (B, T, 1, rd)
    xr, rest = x[..., :rd], x[..., rd:]
    half = rd // 2
    rotated = torch.cat([-xr[..., half:], xr[..., :half]], -1)
    return torch.cat([xr * emb.cos() + rotated * emb.sin(), rest], -1)


def attention(c, lw: AttentionWeights, u: torch.Tensor, kv: KVCache, layer: int, rows: torch.Tensor, ops,
              start: torch.Tensor | None = None, blocks: int = 0) -> torch.Tensor:
    """One attention sublayer over T new tokens of `rows` (B,) of the cache (their blocks
    reserved): u (B, T, d) -> (B, T, d) f32; stores the tokens' keys and values (the caller
    advances the cache's lengths once the whole pass has run). start (B,): left padding.
    blocks: the blocks the rows' contexts span after the pass, at most (0: the table's width):
    the keys read, whatever a row reserved beyond."""
    B, T, _ = u.shape
    H, KVH, hd = c.attn_heads, c.kv_heads, c.attn_head_dim
    q = ops.linear(u, lw.q_w, lw.q_b).view(B, T, H, hd)
    k = ops.linear(u, lw.k_w, lw.k_b).view(B, T, KVH, hd)
    v = ops.linear(u, lw.v_w, lw.v_b).view(B, T, KVH, hd)
    steps = torch.arange(T, device=u.device)
    rel = steps[None, :] - (start.to(u.device, torch.int64)[:, None] if start is not None else 0)
    valid = rel >= 0  # (B, T): not left padding
    pos = kv.lengths[rows][:, None] + rel.clamp(min=0)  # (B, T)
    if c.rope_theta:
        q, k = rope(q, pos, c.rope_theta, c.rotary_dim), rope(k, pos, c.rope_theta, c.rotary_dim)
    bs, width = kv.block_size, blocks or kv.table.shape[1]
    block = kv.table[rows[:, None], (pos // bs).clamp(max=width - 1)]  # (B, T)
    where = torch.where(valid, block * bs + pos % bs, 0).flatten()  # padding to block 0, never read
    kv.k[layer].view(-1, KVH, hd).index_copy_(0, where, k.reshape(B * T, KVH, hd).to(kv.k.dtype))
    kv.v[layer].view(-1, KVH, hd).index_copy_(0, where, v.reshape(B * T, KVH, hd).to(kv.v.dtype))
    scale = c.attn_scale or hd**-0.5
    if T == 1 and start is None and ops.paged_decode is not None:  # a decode step: the paged kernel
        y = ops.paged_decode(q[:, 0], kv.k[layer], kv.v[layer], kv.table, kv.lengths, scale, rows, 1)
        return ops.linear(y.reshape(B, 1, H * hd), lw.o_w, lw.o_b)
    table = kv.table[rows, :width]  # (B, W)
    keys = kv.k[layer][table].flatten(1, 2).float()  # (B, S, KVH, hd)
    values = kv.v[layer][table].flatten(1, 2).float()
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
    y = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2), attn_mask=seen[:, None], scale=scale)
    y = torch.where(valid[:, :, None], y.transpose(1, 2).reshape(B, T, H * hd), 0.0)
    return ops.linear(y, lw.o_w, lw.o_b)
