"""Prefix state cache: the recurrent state after a token prefix, so that a prompt that
starts with a cached prefix prefills only the rest.

A Mamba state has one size whatever the prefix's length, so an entry is exact at any
length and costs the same: the conv and ssm state of every layer for one slot, and the
logits after the prefix's last token (so that a prompt cached whole needs no prefill at
all). A hybrid's entry also holds the keys and values of its attention sublayers for the
prefix (a copy), which grow with its length. The prefixes live in a radix tree over token ids, so a lookup finds the longest cached
prefix of any length in one walk; states are kept at a prompt's end, every INTERVAL tokens
inside long prompts, and at the end of a finished request's prompt + output (where a chat's
next turn starts). Entries live on the model's device under a byte budget, least recently
used first out.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from fastmamba.core.kv_cache import KVCache
from fastmamba.core.state import MambaState


@dataclass
class CachedState:
    conv: torch.Tensor  # (L, 1, E, K)
    ssm: torch.Tensor  # (L, 1, E, N)
    logits: torch.Tensor  # (V,) f32, after the prefix's last token
    kv: KVCache | None = None  # a hybrid's keys and values of the prefix, a one-slot cache of their own

    @property
    def nbytes(self) -> int:
        kv = 0 if self.kv is None else 2 * self.kv.k.numel() * self.kv.k.element_size()
        return kv + sum(t.numel() * t.element_size() for t in (self.conv, self.ssm, self.logits))


# The serving engine's prefill chunks end on this grid, so that a long prompt leaves states
# along the way; 512 because a 2.8b prefill runs at ~24 µs a token in 512-token chunks
# against ~34 in 256-token ones (H200, bf16: cold TTFTs of a 2048-token prompt).
INTERVAL = 512
# The GPU engine's eager prefill (a hybrid's: no prefill graphs) spends the host's time on each
# pass's launches, ~2,000 for a 40-layer model with experts, whatever its length: Granite-4.0-H-
# Tiny's 2048-token prompt in four 512-token passes took 293 ms of wall time against 65 of GPU
# time (H100, 2026-12-07), so its chunks run up to this many tokens a pass.
EAGER_INTERVAL = 2048


class _Node:
    """A radix tree node: the tokens on the edge from its parent, its children by their
    edge's first token, and the state after the prefix it ends (or None)."""

    __slots__ = ("edge", "parent", "children", "entry")

    def __init__(self, edge: tuple[int, ...], parent: "_Node | None"):
        self.edge, self.parent = edge, parent
        self.children: dict[int, _Node] = {}
        self.entry: CachedState | None = None


def _common(edge: tuple[int, ...], ids: list[int], at: int) -> int:
    """How many of edge's tokens ids[at:] starts with."""
    n = 0
    for a, b in zip(edge, ids[at : at + len(edge)]):
        if a != b:
            break
        n += 1
    return n


class PrefixCache:
    """Token prefixes -> CachedState in a radix tree, LRU under `budget_bytes` (0 turns it off)."""

    def __init__(self, budget_bytes: int, interval: int = INTERVAL):
        self.budget = budget_bytes
        self.interval = interval  # inside long prompts, a state is kept every this many tokens
        self._root = _Node((), None)
        self._lru: OrderedDict[_Node, None] = OrderedDict()  # nodes holding an entry, oldest first
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._lru)

    def lookup(self, ids: list[int]) -> tuple[int, CachedState | None]:
        """The longest cached prefix of `ids`, at any length (its length and state; 0 and
        None on a miss)."""
        if not self.budget:
            return 0, None
        node, depth, best = self._root, 0, (0, None)
        while depth < len(ids):
            child = node.children.get(ids[depth])
            if child is None or _common(child.edge, ids, depth) < len(child.edge):
                break
            node, depth = child, depth + len(child.edge)
            if node.entry is not None:
                best = (depth, node)
        n, found = best
        if found is None:
            return 0, None
        self._lru.move_to_end(found)
        return n, found.entry

    def store(self, ids: list[int], state: MambaState, logits: torch.Tensor) -> None:
        """Keeps copies of one slot's state after `ids` (conv (L, 1, E, K), ssm (L, 1, E, N),
        and a hybrid's keys and values of its slot) and the logits after its last token (V,)."""
        if not self.budget or not ids:
            return
        node = self._insert(list(ids))
        if node.entry is not None:
            self._lru.move_to_end(node)
            return
        kv = None
        if state.kv is not None:
            src = state.cache_rows()[0]
            kv = KVCache(state.kv.k.shape[0], *state.kv.k.shape[3:], slots=1, blocks=1 + state.kv.blocks_for(len(ids)),
                         block_size=state.kv.block_size, dtype=state.kv.k.dtype, device=state.kv.k.device)
            kv.copy_slot(0, state.kv, src)
        entry = CachedState(state.conv.clone(), state.ssm.clone(), logits.detach().float().clone(), kv)
        if entry.nbytes > self.budget:
            self._prune(node)
            return
        node.entry = entry
        self._lru[node] = None
        self.bytes += entry.nbytes
        while self.bytes > self.budget:
            old, _ = self._lru.popitem(last=False)
            self.bytes -= old.entry.nbytes
            old.entry = None
            self._prune(old)

    def _insert(self, ids: list[int]) -> _Node:
        """The node that ends at ids, made (splitting an edge where needed) if absent."""
        node, depth = self._root, 0
        while depth < len(ids):
            child = node.children.get(ids[depth])
            if child is None:
                leaf = _Node(tuple(ids[depth:]), node)
                node.children[ids[depth]] = leaf
                return leaf
            n = _common(child.edge, ids, depth)
            if n < len(child.edge):  # the path leaves the edge part-way: a node at the split
                mid = _Node(child.edge[:n], node)
                node.children[ids[depth]] = mid
                child.edge, child.parent = child.edge[n:], mid
                mid.children[child.edge[0]] = child
                child = mid
            node, depth = child, depth + n
        return node

    def _prune(self, node: _Node) -> None:
        """Removes a node that holds nothing and leads nowhere, and its parents that become so;
        then joins a node left holding nothing on one path to its child (a split made for a
        path now gone), so that the tree keeps a node only where a state is or paths part
        (without the join, a long conversation's branches left a node at every old split)."""
        while node is not self._root and node.entry is None and not node.children:
            parent = node.parent
            del parent.children[node.edge[0]]
            node = parent
        if node is not self._root and node.entry is None and len(node.children) == 1:
            (child,) = node.children.values()  # (the child takes the node's place: the LRU keys it)
            child.edge, child.parent = node.edge + child.edge, node.parent
            node.parent.children[child.edge[0]] = child
