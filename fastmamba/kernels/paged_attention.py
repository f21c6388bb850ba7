"""Decode attention over a paged KV cache: each row's one new query against the keys and
values its block table points to, with its `_ref` twin.

Keys and values lie in blocks of BS tokens: row b's token t in block table[b, t // BS] at
offset t % BS; lengths[b] tokens are held (the new token's included). A program takes one
row, one key/value head with the REP query heads that share it (GQA), and one split of the
table's columns; it runs over its blocks below the row's length with a running max and sum
(float32), and writes its partial result; `paged_decode` adds the splits up. The split
depends on the table's width only, never on the batch or the lengths, so a row's result is
the same in any batch, and the launch has one shape for a CUDA graph whatever the context.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._triton import jit, tl, triton


def paged_decode_ref(q, k_cache, v_cache, table, lengths, scale: float, rows=None, extra: int = 0) -> torch.Tensor:
    """q (B, H, hd) f32; k_cache, v_cache (blocks, BS, KVH, hd); table (slots, W) int64;
    lengths (slots,) int64; rows (B,): each query's slot (None: 0 .. B-1) -> (B, H, hd) f32:
    softmax(q k^T * scale) v over the first lengths[slot] + extra tokens of the row's slot,
    in float32."""
    if rows is not None:
        table, lengths = table[rows], lengths[rows]
    lengths = lengths + extra
    B, H, hd = q.shape
    KVH = k_cache.shape[2]
    keys = k_cache[table].flatten(1, 2).float()  # (B, W BS, KVH, hd)
    values = v_cache[table].flatten(1, 2).float()
    held = torch.arange(keys.shape[1], device=q.device)[None, :] < lengths[:, None]  # (B, S)
    scores = torch.einsum("bgrd,bsgd->bgrs", q.float().view(B, KVH, H // KVH, hd), keys) * scale
    scores = scores.masked_fill(~held[:, None, None], float("-inf"))
    return torch.einsum("bgrs,bsgd->bgrd", torch.softmax(scores, dim=-1), values).reshape(B, H, hd)


@dataclass(frozen=True)
class PagedTiles:
    splits: int  # programs a row and head, each over an equal share of the table's columns
    warps: int


@jit
def _paged_decode_kernel(
    q_ptr, k_ptr, v_ptr, table_ptr, len_ptr, rows_ptr, m_ptr, l_ptr, acc_ptr,
    W, per_split, scale, extra,
    KVH: tl.constexpr, REP: tl.constexpr, RP: tl.constexpr, HD: tl.constexpr, HP: tl.constexpr,
    BS: tl.constexpr, SPLITS: tl.constexpr,
):
    b = tl.program_id(0)
    g = tl.program_id(1)
    s = tl.program_id(2)
    b64 = b.to(tl.int64)
    r = tl.arange(0, RP)
    d = tl.arange(0, HP)
    rmask, dmask = r < REP, d < HD
    H = KVH * REP
    q = tl.load(q_ptr + (b64 * H + g * REP + r[:, None]) * HD + d[None, :], mask=rmask[:, None] & dmask[None, :],
                other=0.0).to(tl.float32) * scale  # (RP, HP)
    slot = tl.load(rows_ptr + b).to(tl.int64)
    length = tl.load(len_ptr + slot) + extra
    first = s * per_split
    last = tl.minimum(first + per_split, tl.cdiv(length, BS))
    m = tl.full([RP], -1.0e30, dtype=tl.float32)
    l = tl.zeros([RP], dtype=tl.float32)
    acc = tl.zeros([RP, HP], dtype=tl.float32)
    t = tl.arange(0, BS)
    for blk in range(first, last):
        block = tl.load(table_ptr + slot * W + blk)
        at = ((block * BS + t[:, None]) * KVH + g) * HD + d[None, :]  # (BS, HP)
        kv_mask = dmask[None, :] & (blk * BS + t[:, None] < length)
        k = tl.load(k_ptr + at, mask=kv_mask, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + at, mask=kv_mask, other=0.0).to(tl.float32)
        held = (blk * BS + t) < length  # (BS,)
        scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2)  # (RP, BS)
        scores = tl.where(held[None, :], scores, -1.0e30)
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        p = tl.where(held[None, :], tl.exp(scores - m_new[:, None]), 0.0)
        alpha = tl.exp(m - m_new)
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m = m_new
    part = (b64 * KVH + g) * SPLITS + s
    tl.store(m_ptr + part * RP + r, m)
    tl.store(l_ptr + part * RP + r, l)
    tl.store(acc_ptr + (part * RP + r[:, None]) * HP + d[None, :], acc)


def paged_decode(q, k_cache, v_cache, table, lengths, scale: float, rows=None, extra: int = 0, *,
                 tiles: PagedTiles) -> torch.Tensor:
    """paged_decode_ref's result through the kernel: (B, H, hd) f32."""
    B, H, hd = q.shape
    if rows is None:
        rows = torch.arange(B, device=q.device)
    KVH, BS = k_cache.shape[2], k_cache.shape[1]
    REP = H // KVH
    RP, HP = triton.next_power_of_2(REP), triton.next_power_of_2(hd)
    W = table.shape[1]
    S = tiles.splits
    per_split = triton.cdiv(W, S)
    m = torch.empty(B, KVH, S, RP, device=q.device, dtype=torch.float32)
    l = torch.empty_like(m)
    acc = torch.empty(B, KVH, S, RP, HP, device=q.device, dtype=torch.float32)
    _paged_decode_kernel[(B, KVH, S)](
        q.contiguous(), k_cache, v_cache, table, lengths, rows, m, l, acc, W, per_split, scale, extra,
        KVH=KVH, REP=REP, RP=RP, HD=hd, HP=HP, BS=BS, SPLITS=S, num_warps=tiles.warps,
    )
    top = m.amax(dim=2, keepdim=True)  # (B, KVH, 1, RP)
    w = torch.exp(m - top)  # (a split with no block: m = -1e30, weight 0)
    out = (acc * w[..., None]).sum(2) / (l * w).sum(2)[..., None]  # (B, KVH, RP, HP)
    return out[:, :, :REP, :hd].reshape(B, H, hd)
