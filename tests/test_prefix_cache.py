"""The prefix cache's radix tree: the longest cached prefix at any length, LRU under a budget."""

from __future__ import annotations

import random

import torch

from fastmamba.core.state import MambaState
from fastmamba.engine.prefix_cache import PrefixCache


def state(value: float):
    """(one slot's state, logits) of a value."""
    t = torch.full((1, 1, 1, 1), float(value))
    return MambaState(t, t.clone()), torch.full((3,), float(value))


def test_the_longest_cached_prefix_at_any_length_against_brute_force():
    rng = random.Random(0)
    cache, keys, first = PrefixCache(1 << 30), {}, {}
    for _ in range(1500):
        key = tuple(rng.randint(0, 3) for _ in range(rng.randint(1, 9)))
        value = len(first)
        first.setdefault(key, value)  # (a prefix stored again keeps its first state)
        keys[key] = value
        cache.store(list(key), *state(value))
    for _ in range(1500):
        query = [rng.randint(0, 3) for _ in range(rng.randint(1, 12))]
        want = max((k for k in keys if tuple(query[: len(k)]) == k), key=len, default=None)
        n, entry = cache.lookup(query)
        if want is None:
            assert (n, entry) == (0, None)
        else:
            assert n == len(want) and entry.ssm.item() == entry.logits[0] == first[want]


def test_a_stored_state_is_a_copy():
    one, logits = state(1)
    cache = PrefixCache(1 << 20)
    cache.store([5, 6], one, logits)
    one.ssm.fill_(7)
    assert cache.lookup([5, 6, 7])[1].ssm.item() == 1


def test_the_budget_evicts_the_least_recently_used():
    s, logits = state(0)
    one = sum(t.numel() * t.element_size() for t in (s.conv, s.ssm, logits))
    cache = PrefixCache(3 * one)
    for i in range(3):
        cache.store([i, i, i], *state(i))
    cache.lookup([0, 0, 0])  # 0 is now the most recent: 1 goes first
    cache.store([9], *state(9))
    assert [cache.lookup([i, i, i])[0] for i in range(3)] == [3, 0, 3]
    assert len(cache) == 3 and cache.bytes == 3 * one
    assert set(cache._root.children) == {0, 2, 9}  # the evicted path is pruned


def test_off_with_no_budget():
    cache = PrefixCache(0)
    cache.store([1, 2], *state(1))
    assert cache.lookup([1, 2]) == (0, None) and len(cache) == 0


def test_the_tree_keeps_nodes_only_where_states_are_or_paths_part():
    """Branches off one long conversation at random points, four kept under the budget: a
    split left by an evicted branch is joined back (its nodes grew toward one a token of the
    path: 408 after 3000 stores); and every kept state is still found whole."""
    s, logits = state(0)
    one = sum(t.numel() * t.element_size() for t in (s.conv, s.ssm, logits))
    cache = PrefixCache(4 * one)
    rng = random.Random(0)
    base = [rng.randrange(5) for _ in range(2000)]
    kept = {}
    for i in range(600):
        ids = base[: rng.randrange(1, 2000)] + [rng.randrange(5, 9)]
        cache.store(ids, *state(i))
        kept.setdefault(tuple(ids), i)  # (a path stored again keeps its first state)

    def nodes(node):
        return 1 + sum(nodes(c) for c in node.children.values())

    assert len(cache) == 4 and nodes(cache._root) <= 2 * len(cache) + 1
    found = [(ids, i) for ids, i in kept.items() if cache.lookup(list(ids))[0] == len(ids)]
    assert len(found) == 4
    for ids, i in found:
        assert cache.lookup(list(ids))[1].ssm.item() == i
