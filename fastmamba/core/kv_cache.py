"""The attention sublayers' keys and values, paged: fixed-size blocks from one pool, and a
table a slot of the blocks its tokens lie in (as vLLM's PagedAttention), so that a slot
holds only the blocks its context uses.

Slot s's token t lies in block `table[s, t // block_size]` at offset `t % block_size`;
`lengths[s]` tokens are held. Block 0 is never handed out: a table's unused entries point
to it, and the tokens a pass must not store (left padding) are written there, where no
length reaches. Blocks are handed out and taken back on the host (`reserve`, `release`),
before the pass that writes them; a pass only writes and reads.
"""

from __future__ import annotations

import math

import torch

from fastmamba.core.transfer import to_device


def bytes_per_token(config, element_size: int) -> int:
    """A token's keys and values in every attention sublayer of a model of `config`."""
    return 2 * config.n_attention * config.kv_heads * config.attn_head_dim * element_size


class KVCacheFull(RuntimeError):
    """The pool has no free block for a reservation."""


class KVCache:
    def __init__(self, layers: int, kv_heads: int, head_dim: int, slots: int, blocks: int, block_size: int = 16,
                 max_tokens: int | None = None, dtype=torch.float32, device="cpu", growable: bool = False):
        """layers: the attention sublayers; blocks: the pool's blocks (block 0 included);
        max_tokens: a slot's context at most (its table's width; default: the pool's).
        growable: the pool grows when a reservation needs more blocks than are free (a
        prefill's or a forward's); otherwise its tensors never change, as CUDA graphs need,
        and its table has its full width from the start."""
        self.block_size, self.growable = block_size, growable
        shape = (layers, blocks, block_size, kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.max_blocks = math.ceil(max_tokens / block_size) if max_tokens else (1 << 20 if growable else blocks - 1)
        width = 1 if growable else self.max_blocks  # (a growable table widens as slots grow)
        self.table = torch.zeros(slots, width, dtype=torch.int64, device=device)
        self.lengths = torch.zeros(slots, dtype=torch.int64, device=device)
        self.free = list(range(blocks - 1, 0, -1))  # a stack: the lowest block first
        self.owned: list[list[int]] = [[] for _ in range(slots)]
        self.held = [0] * slots  # lengths, on the host

    @classmethod
    def for_tokens(cls, config, slots: int, tokens: int, dtype, device, block_size: int = 16) -> "KVCache":
        """A pool with room for `tokens` tokens in each of `slots` slots (a prefill's, or a
        forward's), that grows when asked for more."""
        per_slot = math.ceil(max(tokens, 1) / block_size)
        return cls(config.n_attention, config.kv_heads, config.attn_head_dim, slots, 1 + slots * per_slot, block_size,
                   dtype=dtype, device=device, growable=True)

    @property
    def slots(self) -> int:
        return self.lengths.shape[0]

    @property
    def blocks(self) -> int:
        return self.k.shape[1]

    @property
    def request_blocks(self) -> int:
        """The most blocks one request's context may hold: its table's width, within the pool's."""
        return min(self.blocks - 1, self.max_blocks)

    @property
    def free_tokens(self) -> int:
        return len(self.free) * self.block_size

    def blocks_for(self, tokens: int) -> int:
        return math.ceil(tokens / self.block_size)

    def reserve(self, slot: int, tokens: int) -> None:
        """Blocks enough for slot `slot` to hold `tokens` tokens (its own and those to come in
        the next pass). KVCacheFull if the pool has too few (a growable pool grows)."""
        need = self.blocks_for(tokens) - len(self.owned[slot])
        if need <= 0:
            return
        if self.blocks_for(tokens) > self.max_blocks:
            raise KVCacheFull(f"a context of {tokens} tokens is over the cache's {self.max_blocks * self.block_size}")
        if need > len(self.free):
            if not self.growable:
                raise KVCacheFull(f"{need} KV blocks asked for, {len(self.free)} free")
            self._grow(need - len(self.free))
        new = [self.free.pop() for _ in range(need)]
        first = len(self.owned[slot])
        self.owned[slot] += new
        if len(self.owned[slot]) > self.table.shape[1]:
            wider = torch.zeros(self.slots, len(self.owned[slot]), dtype=self.table.dtype, device=self.table.device)
            wider[:, : self.table.shape[1]] = self.table
            self.table = wider
        self.table[slot, first : first + need] = to_device(new, self.table.device)

    def _grow(self, blocks: int) -> None:
        old = self.blocks
        extra = max(blocks, old)  # (doubling: few regrowths)
        pad = (self.k.shape[0], extra, *self.k.shape[2:])
        self.k = torch.cat([self.k, self.k.new_zeros(pad)], 1)
        self.v = torch.cat([self.v, self.v.new_zeros(pad)], 1)
        self.free = list(range(old + extra - 1, old - 1, -1)) + self.free

    def release(self, slot: int) -> None:
        """Slot `slot` holds nothing: its blocks go back to the pool."""
        self.free += reversed(self.owned[slot])
        self.owned[slot] = []
        self.held[slot] = 0
        self.table[slot] = 0
        self.lengths[slot] = 0

    def advance(self, rows: list[int], counts: list[int]) -> None:
        """After a pass: each of `rows` holds `counts` more tokens."""
        for r, n in zip(rows, counts):
            self.held[r] += n
        self.lengths.index_add_(0, to_device(rows, self.lengths.device), to_device(counts, self.lengths.device))

    def after_graph_step(self, decoded: int, rows: int) -> None:
        """After a CUDA graph's decode step of the first `rows` slots, which stored a token for
        each and advanced their lengths on the device alone: the first `decoded` took a token
        (their host lengths follow); the rest were padding (their lengths go back)."""
        for r in range(decoded):
            if self.held[r] + 1 > len(self.owned[r]) * self.block_size:  # (the graph stored past its blocks)
                raise RuntimeError(f"KV cache slot {r} holds {self.held[r] + 1} tokens in {len(self.owned[r])} blocks "
                                   f"of {self.block_size}: its context was not reserved")
        for r in range(decoded):
            self.held[r] += 1
        if rows > decoded:
            self.lengths[decoded:rows].copy_(to_device(self.held[decoded:rows], self.lengths.device))

    def copy_slot(self, dst: int, src_cache: "KVCache", src: int) -> None:
        """dst's context becomes src_cache's slot src's (a copy: blocks of its own). The blocks
        dst has reserved stay its own: a request's whole context is reserved at admission,
        before its prompt's keys and values are copied in, and a decode step in a CUDA graph
        reserves nothing (its stores past the reservation would land in block 0)."""
        self.held[dst] = 0
        self.lengths[dst] = 0
        n = src_cache.held[src]
        if n == 0:
            return
        self.reserve(dst, n)
        nb = self.blocks_for(n)
        src_blocks = to_device(src_cache.owned[src][:nb], src_cache.k.device)
        dst_blocks = to_device(self.owned[dst][:nb], self.k.device)
        self.k[:, dst_blocks] = src_cache.k[:, src_blocks].to(self.k.device, self.k.dtype)
        self.v[:, dst_blocks] = src_cache.v[:, src_blocks].to(self.v.device, self.v.dtype)
        self.advance([dst], [n])

    def swap(self, a: int, b: int) -> None:
        """Slots a and b trade contexts (the engine keeps its decoding slots first)."""
        self.owned[a], self.owned[b] = self.owned[b], self.owned[a]
        self.held[a], self.held[b] = self.held[b], self.held[a]
        for t in (self.table, self.lengths):
            row = t[a].clone()
            t[a] = t[b]
            t[b] = row
