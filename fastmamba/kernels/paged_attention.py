"""Decode attention over a paged KV cache: each row's one new token (its query, key and value
from one product) rotated, its key and value stored, its query against the keys and values
its block table points to; with `_ref` twins.

Keys and values lie in blocks of BS tokens: row b's token t in block table[b, t // BS] at
offset t % BS; lengths[b] tokens are held before the step, the new token goes at position
lengths[b] (the engine advances the lengths once the pass has run). Three launches a step
where the sublayer's torch ops took about twenty:
- `_rope_store_kernel`: a program a row and head rotates the query head (RoPE), or rotates
  the key head and stores it and the value head in their block;
- `_paged_decode_kernel`: a program takes one row, one key/value head with the REP query
  heads that share it (GQA), and one of SPLITS splits of the row's tokens (as many programs
  a row whatever its key/value heads), every SPLITS-th run of BN tokens (BN / BS blocks)
  below the row's length from its own; it runs over them with a running max and sum
  (float32), the scores and the weighted values as tensor-core products (16-bit caches: the
  scaled query and the weights rounded to their dtype; float32 ones in three TF32 passes,
  float32's accuracy), and writes its partial result; a split with no run returns at once;
- `_paged_combine_kernel`: a program a row and query head adds up the splits that ran.
The blocks a split takes depend on the row's own length alone, never on the batch or the
table's width, so a row's result is the same in any batch, every split has a share of any
context, and the launch has one shape for a CUDA graph whatever the context. (Splits of
contiguous columns of the table, as before, left all but the first idle below an eighth of
the table's width: at batch 128 and 1k-token contexts the kernel ran at a fifth of the
bandwidth floor. Scores and weighted values as broadcast products and sums over one block at
a time, before they went to the tensor cores, took 2,122 instructions a thread a block, 472 of them
shuffles: at batch 128 the kernel was bound by instructions, not bytes.)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ._triton import jit, tl, triton
from .products import tensor_dot


def rope_ref(x: torch.Tensor, pos: torch.Tensor, theta: float, rotary_dim: int) -> torch.Tensor:
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


def store_ref(k_cache, v_cache, table, rows, pos, k, v, valid=None, width: int = 0) -> None:
    """Keys and values k, v (B, T, KVH, hd) stored in the cache (blocks, BS, KVH, hd) at
    positions pos (B, T) of the rows' slots (rows (B,)): in block table[slot, pos // BS] of the
    table's first `width` columns (0: all), at offset pos % BS; where `valid` (B, T) is False
    (left padding, no token), in block 0, which no table hands out for reading."""
    B, T, KVH, hd = k.shape
    BS = k_cache.shape[1]
    block = table[rows[:, None], (pos // BS).clamp(max=(width or table.shape[1]) - 1)]  # (B, T)
    where = block * BS + pos % BS
    if valid is not None:
        where = torch.where(valid, where, 0)
    for cache, x in ((k_cache, k), (v_cache, v)):
        cache.view(-1, KVH, hd).index_copy_(0, where.flatten(), x.reshape(B * T, KVH, hd).to(cache.dtype))


def decode_attention_ref(qkv, k_cache, v_cache, table, lengths, rows, heads: int, scale: float, theta: float = 0.0,
                         rotary_dim: int = 0) -> torch.Tensor:
    """One new token a row: qkv (B, (H + 2 KVH) hd) f32 (the query heads, then the key and
    the value heads), rows (B,) their slots; the query and key rotated at position
    lengths[rows] (theta 0: no RoPE), the key and value stored there in the cache (blocks,
    BS, KVH, hd), and the query against the slot's lengths + 1 tokens -> (B, H hd) f32."""
    B = qkv.shape[0]
    KVH, hd = k_cache.shape[2], k_cache.shape[3]
    q, k, v = qkv.view(B, heads + 2 * KVH, hd).split([heads, KVH, KVH], dim=1)
    pos = lengths[rows]  # (B,)
    if theta:
        q, k = (rope_ref(t[:, None], pos[:, None], theta, rotary_dim)[:, 0] for t in (q, k))
    store_ref(k_cache, v_cache, table, rows, pos[:, None], k[:, None], v[:, None])
    return paged_decode_ref(q, k_cache, v_cache, table, lengths, scale, rows, 1).reshape(B, heads * hd)


def paged_decode_ref(q, k_cache, v_cache, table, lengths, scale: float, rows=None, extra: int = 0) -> torch.Tensor:
    """q (B, H, hd) f32; k_cache, v_cache (blocks, BS, KVH, hd); table (slots, W) int64;
    lengths (slots,) int64; rows (B,): each query's slot (None: 0 .. B-1) -> (B, H, hd) f32:
    softmax(q k^T * scale) v over the first lengths[slot] + extra tokens of the row's slot,
    sums in float32. With 16-bit keys and values, the two products' other operands (the
    scaled query, the weights) are rounded to their dtype, as the kernel's tensor-core
    products round them (DESIGN §4: a 16-bit product's operands rounded once)."""
    if rows is not None:
        table, lengths = table[rows], lengths[rows]
    lengths = lengths + extra
    B, H, hd = q.shape
    KVH = k_cache.shape[2]
    keys = k_cache[table].flatten(1, 2).float()  # (B, W BS, KVH, hd)
    values = v_cache[table].flatten(1, 2).float()
    held = torch.arange(keys.shape[1], device=q.device)[None, :] < lengths[:, None]  # (B, S)
    rounded = k_cache.dtype  # (float32 keys: nothing rounded)
    q = (q.float() * scale).to(rounded).float()
    scores = torch.einsum("bgrd,bsgd->bgrs", q.view(B, KVH, H // KVH, hd), keys)
    scores = scores.masked_fill(~held[:, None, None], float("-inf"))
    weights = torch.softmax(scores, dim=-1).to(rounded).float()
    return torch.einsum("bgrs,bsgd->bgrd", weights, values).reshape(B, H, hd)


@dataclass(frozen=True)
class PagedTiles:
    programs: int  # a row's programs, over its key/value heads: programs // heads splits a head
    warps: int
    tokens: int  # a run: the tokens a program's products take at once (a power of two, >= 16)


@jit
def _paged_decode_kernel(
    q_ptr, k_ptr, v_ptr, table_ptr, len_ptr, rows_ptr, m_ptr, l_ptr, acc_ptr,
    W, scale, extra,
    KVH: tl.constexpr, REP: tl.constexpr, RP: tl.constexpr, QP: tl.constexpr, HD: tl.constexpr, HP: tl.constexpr,
    BS: tl.constexpr, BN: tl.constexpr, SPLITS: tl.constexpr, F32: tl.constexpr,
):
    b = tl.program_id(0)
    g = tl.program_id(1)
    s = tl.program_id(2)
    b64 = b.to(tl.int64)
    # (QP >= 16 rows, the tensor cores' least; rows from REP on are zeros, never stored)
    r = tl.arange(0, QP)
    d = tl.arange(0, HP)
    rmask, dmask = r < REP, d < HD
    H = KVH * REP
    q = tl.load(q_ptr + (b64 * H + g * REP + r[:, None]) * HD + d[None, :], mask=rmask[:, None] & dmask[None, :],
                other=0.0).to(tl.float32) * scale
    q = q.to(k_ptr.dtype.element_ty)  # (QP, HP): a product's operand, in the cache's dtype
    slot = tl.load(rows_ptr + b).to(tl.int64)
    length = tl.load(len_ptr + slot) + extra
    if s * BN >= length:  # (no run: nothing to write, the combine reads only the splits that ran)
        return
    m = tl.full([QP], -1.0e30, dtype=tl.float32)
    l = tl.zeros([QP], dtype=tl.float32)
    acc = tl.zeros([QP, HP], dtype=tl.float32)
    j = tl.arange(0, BN)
    for run in range(s, tl.cdiv(length, BN), SPLITS):
        tok = run * BN + j
        held = tok < length  # (BN,)
        block = tl.load(table_ptr + slot * W + tok // BS, mask=held, other=0)
        at = ((block * BS + tok % BS)[:, None] * KVH + g) * HD + d[None, :]  # (BN, HP)
        kv_mask = held[:, None] & dmask[None, :]
        k = tl.load(k_ptr + at, mask=kv_mask, other=0.0)
        v = tl.load(v_ptr + at, mask=kv_mask, other=0.0)
        scores = tensor_dot(q, tl.trans(k), tl.zeros([QP, BN], dtype=tl.float32), F32)  # (QP, BN)
        scores = tl.where(held[None, :], scores, -1.0e30)
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        p = tl.where(held[None, :], tl.exp(scores - m_new[:, None]), 0.0)
        alpha = tl.exp(m - m_new)
        l = l * alpha + tl.sum(p, axis=1)
        acc = tensor_dot(p.to(v.dtype), v, acc * alpha[:, None], F32)
        m = m_new
    part = (b64 * KVH + g) * SPLITS + s
    kept = r < RP
    tl.store(m_ptr + part * RP + r, m, mask=kept)
    tl.store(l_ptr + part * RP + r, l, mask=kept)
    tl.store(acc_ptr + (part * RP + r[:, None]) * HP + d[None, :], acc, mask=kept[:, None])


@jit
def _paged_combine_kernel(m_ptr, l_ptr, acc_ptr, out_ptr, len_ptr, rows_ptr, extra, KVH: tl.constexpr,
                          REP: tl.constexpr, RP: tl.constexpr, HD: tl.constexpr, HP: tl.constexpr, BN: tl.constexpr,
                          SPLITS: tl.constexpr, SP: tl.constexpr):
    """One row's query head: the splits that had a run added up, each weighted by exp(its max
    - the largest), the sums of values over the sums of weights. (A program a query head: its
    (splits, head_dim) partial sums fit one program's registers at 64 splits.)"""
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    g, r = h // REP, h % REP
    s = tl.arange(0, SP)
    d = tl.arange(0, HP)
    length = tl.load(len_ptr + tl.load(rows_ptr + b).to(tl.int64)) + extra
    ran = s < tl.minimum(SPLITS, tl.cdiv(length, BN))  # (SP,)
    part = ((b * KVH + g) * SPLITS + s) * RP + r  # (SP,)
    m = tl.load(m_ptr + part, mask=ran, other=-1.0e30)
    w = tl.where(ran, tl.exp(m - tl.max(m, axis=0)), 0.0)
    l = tl.sum(tl.load(l_ptr + part, mask=ran, other=0.0) * w, axis=0)
    acc = tl.load(acc_ptr + part[:, None] * HP + d[None, :], mask=ran[:, None], other=0.0)  # (SP, HP)
    out = tl.sum(acc * w[:, None], axis=0) / l  # (HP,)
    tl.store(out_ptr + (b * KVH * REP + h) * HD + d, out, mask=d < HD)


@jit
def _rope_store_kernel(qkv_ptr, q_ptr, k_ptr, v_ptr, table_ptr, len_ptr, rows_ptr, W, log2_theta,
                       H: tl.constexpr, KVH: tl.constexpr, HD: tl.constexpr, HP: tl.constexpr, BS: tl.constexpr,
                       ROT: tl.constexpr):
    """Program (b, h): query head h < H rotated into q; else key/value head h - H, its key
    rotated, both stored at the row's position lengths[rows[b]] in their block."""
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    d = tl.arange(0, HP)
    dmask = d < HD
    slot = tl.load(rows_ptr + b).to(tl.int64)
    pos = tl.load(len_ptr + slot)
    src = qkv_ptr + b * ((H + 2 * KVH) * HD) + h * HD
    x = tl.load(src + d, mask=dmask, other=0.0).to(tl.float32)
    if ROT > 0:
        # pairs (i, i + ROT / 2) turned by pos * theta^(-2i / ROT), as rope_ref
        half: tl.constexpr = ROT // 2
        rot = d < ROT
        first = d < half
        partner = tl.load(src + tl.where(first, d + half, d - half), mask=rot, other=0.0).to(tl.float32)
        i = tl.where(first, d, d - half).to(tl.float32)
        inv = 1.0 / tl.exp2(i * (2.0 / ROT) * log2_theta)
        angle = pos.to(tl.float32) * inv
        turned = x * tl.cos(angle) + tl.where(first, -partner, partner) * tl.sin(angle)
        x = tl.where(rot, turned, x)
    if h < H:
        tl.store(q_ptr + (b * H + h) * HD + d, x, mask=dmask)
    else:
        g = h - H
        block = tl.load(table_ptr + slot * W + tl.minimum(pos // BS, W - 1))
        at = ((block * BS + pos % BS) * KVH + g) * HD + d
        tl.store(k_ptr + at, x.to(k_ptr.dtype.element_ty), mask=dmask)
        v = tl.load(src + KVH * HD + d, mask=dmask, other=0.0)
        tl.store(v_ptr + at, v.to(v_ptr.dtype.element_ty), mask=dmask)


def paged_decode(q, k_cache, v_cache, table, lengths, scale: float, rows=None, extra: int = 0, *,
                 tiles: PagedTiles) -> torch.Tensor:
    """paged_decode_ref's result through the kernel: (B, H, hd) f32."""
    B, H, hd = q.shape
    if rows is None:
        rows = torch.arange(B, device=q.device)
    KVH, BS = k_cache.shape[2], k_cache.shape[1]
    REP = H // KVH
    # (16 at least: the tensor-core products' least width)
    RP, HP = triton.next_power_of_2(REP), max(16, triton.next_power_of_2(hd))
    W = table.shape[1]
    # (from the heads alone, never the batch or the context: a row's sums in one order in any
    # batch; at batch 1 about `programs` programs share a long context, whatever the heads)
    S = max(1, tiles.programs // KVH)
    m = torch.empty(B, KVH, S, RP, device=q.device, dtype=torch.float32)
    l = torch.empty_like(m)
    acc = torch.empty(B, KVH, S, RP, HP, device=q.device, dtype=torch.float32)
    _paged_decode_kernel[(B, KVH, S)](
        q.contiguous(), k_cache, v_cache, table, lengths, rows, m, l, acc, W, scale, extra,
        KVH=KVH, REP=REP, RP=RP, QP=max(16, RP), HD=hd, HP=HP, BS=BS, BN=tiles.tokens, SPLITS=S,
        F32=k_cache.dtype == torch.float32, num_warps=tiles.warps,
    )
    out = torch.empty(B, H, hd, device=q.device, dtype=torch.float32)
    _paged_combine_kernel[(B, H)](m, l, acc, out, lengths, rows, extra, KVH=KVH, REP=REP, RP=RP, HD=hd, HP=HP,
                                  BN=tiles.tokens, SPLITS=S, SP=triton.next_power_of_2(S), num_warps=4)
    return out


def decode_attention(qkv, k_cache, v_cache, table, lengths, rows, heads: int, scale: float, theta: float = 0.0,
                     rotary_dim: int = 0, *, tiles: PagedTiles) -> torch.Tensor:
    """decode_attention_ref's result and stores through the kernels: (B, H hd) f32."""
    B = qkv.shape[0]
    KVH, hd, BS = k_cache.shape[2], k_cache.shape[3], k_cache.shape[1]
    q = torch.empty(B, heads, hd, device=qkv.device, dtype=torch.float32)
    _rope_store_kernel[(B, heads + KVH)](
        qkv.contiguous(), q, k_cache, v_cache, table, lengths, rows, table.shape[1],
        math.log2(theta) if theta else 0.0, H=heads, KVH=KVH, HD=hd, HP=triton.next_power_of_2(hd), BS=BS,
        ROT=rotary_dim if theta else 0, num_warps=1,
    )
    return paged_decode(q, k_cache, v_cache, table, lengths, scale, rows, 1, tiles=tiles).view(B, heads * hd)
