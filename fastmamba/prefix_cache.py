"""Prefix state cache: the recurrent state after a token prefix, so that a prompt that
starts with a cached prefix prefills only the rest.

A Mamba state has one size whatever the prefix's length, so an entry is exact at any
length and costs the same: the conv and ssm state of every layer for one slot, and the
logits after the prefix's last token (so that a prompt cached whole needs no prefill at
all). Entries live on the model's device under a byte budget, least recently used first out.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch


@dataclass
class CachedState:
    conv: torch.Tensor  # (L, 1, E, K)
    ssm: torch.Tensor  # (L, 1, E, N)
    logits: torch.Tensor  # (V,) f32, after the prefix's last token

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.conv, self.ssm, self.logits))


# The serving engine's prefill chunks end on this grid, so that a prefix hit resumes
# where a cold prefill cuts; 512 because a 2.8b prefill runs at ~24 µs a token in
# 512-token chunks against ~34 in 256-token ones (H200, bf16: cold TTFTs of a 2048-token prompt).
INTERVAL = 512


class PrefixCache:
    """Token prefixes -> CachedState, LRU under `budget_bytes` (0 turns it off)."""

    def __init__(self, budget_bytes: int, interval: int = INTERVAL):
        self.budget = budget_bytes
        self.interval = interval  # inside long prompts, a state is kept every this many tokens
        self._entries: OrderedDict[tuple[int, ...], CachedState] = OrderedDict()
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, ids: list[int]) -> tuple[int, CachedState | None]:
        """The longest cached prefix of `ids` (its length and state; 0 and None on a miss).
        Only the prompt's own length and the interval's multiples can have been stored."""
        if not self.budget:
            return 0, None
        lengths = [len(ids)] + list(range((len(ids) - 1) // self.interval * self.interval, 0, -self.interval))
        for n in lengths:
            entry = self._entries.get(tuple(ids[:n]))
            if entry is not None:
                self._entries.move_to_end(tuple(ids[:n]))
                return n, entry
        return 0, None

    def store(self, ids: list[int], conv: torch.Tensor, ssm: torch.Tensor, logits: torch.Tensor) -> None:
        """Keeps copies of the state after `ids` (one slot's conv (L, 1, E, K), ssm (L, 1, E, N))."""
        key = tuple(ids)
        if not self.budget or key in self._entries:
            if key in self._entries:
                self._entries.move_to_end(key)
            return
        entry = CachedState(conv.clone(), ssm.clone(), logits.detach().float().clone())
        if entry.nbytes > self.budget:
            return
        self._entries[key] = entry
        self.bytes += entry.nbytes
        while self.bytes > self.budget:
            _, old = self._entries.popitem(last=False)
            self.bytes -= old.nbytes
