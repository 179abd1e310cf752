"""The prefix index: chained block hashes, longest-prefix matching, LRU bound, TTL, KV events."""

from __future__ import annotations

import pytest

from regions.edge.policy.prefix_index import PrefixIndex, SeenPrefixes, block_hashes, root_seed

SEED = root_seed("llama")


def text(n_blocks: int, tag: str = "a", block: int = 64) -> bytes:
    return b"".join(f"{tag}{i:04d}".encode().ljust(block, b".") for i in range(n_blocks))


def test_hashes_are_chained_so_equal_blocks_at_different_depths_differ() -> None:
    same = b"x" * 64
    hashes = block_hashes(same * 3, SEED)
    assert len(hashes) == 3
    assert len(set(hashes)) == 3


def test_a_common_prefix_shares_hashes_until_the_first_difference() -> None:
    a = block_hashes(text(4) + text(2, "b"), SEED)
    b = block_hashes(text(4) + text(2, "c"), SEED)
    assert a[:4] == b[:4]
    assert a[4] != b[4] and a[5] != b[5]


def test_partial_tail_block_is_not_hashed_and_model_seed_separates_caches() -> None:
    assert block_hashes(b"y" * 63, SEED) == []
    assert len(block_hashes(b"y" * 130, SEED)) == 2
    assert block_hashes(b"y" * 64, SEED) != block_hashes(b"y" * 64, root_seed("other"))


def test_match_counts_leading_blocks_per_instance() -> None:
    idx = PrefixIndex(capacity=1000)
    long = block_hashes(text(6), SEED)
    idx.insert(long, "i-1", now=0.0)
    idx.insert(long[:2], "i-2", now=0.0)
    assert idx.match(long, now=1.0) == {"i-1": 6, "i-2": 2}
    other = block_hashes(text(3, "z"), SEED)
    assert idx.match(other, now=1.0) == {}


def test_memory_is_bounded_and_eviction_shortens_the_oldest_chain_from_its_tail() -> None:
    idx = PrefixIndex(capacity=10)
    old = block_hashes(text(6, "o"), SEED)
    new = block_hashes(text(6, "n"), SEED)
    idx.insert(old, "i-1", now=0.0)
    idx.insert(new, "i-2", now=1.0)
    assert len(idx) == 10
    # The two least recently used blocks are the tail of ``old``: what is left is a prefix.
    assert idx.match(old, now=2.0) == {"i-1": 4}
    assert idx.match(new, now=2.0) == {"i-2": 6}
    for k in range(3):
        idx.insert(block_hashes(text(2, f"x{k}"), SEED), "i-3", now=3.0 + k)
    assert idx.match(old, now=9.0) == {}


def test_match_finds_the_deepest_block_of_each_instance() -> None:
    idx = PrefixIndex(capacity=10_000)
    hashes = block_hashes(text(100), SEED)
    for depth, inst in ((1, "a"), (37, "b"), (99, "c"), (100, "d")):
        idx.insert(hashes[:depth], inst, now=0.0)
    assert idx.match(hashes, now=0.0) == {"a": 1, "b": 37, "c": 99, "d": 100}
    assert idx.match(hashes[:50], now=0.0) == {"a": 1, "b": 37, "c": 50, "d": 50}


def test_touching_a_prefix_keeps_it_alive_under_pressure() -> None:
    idx = PrefixIndex(capacity=8)
    hot = block_hashes(text(4, "h"), SEED)
    idx.insert(hot, "i-1", now=0.0)
    for k in range(5):
        idx.insert(block_hashes(text(1, f"c{k}"), SEED), "i-2", now=float(k))
        idx.insert(hot, "i-1", now=float(k))
    assert idx.match(hot, now=5.0) == {"i-1": 4}


def test_entries_older_than_the_ttl_are_not_trusted() -> None:
    idx = PrefixIndex(capacity=100, ttl_s=10.0)
    hashes = block_hashes(text(3), SEED)
    idx.insert(hashes, "i-1", now=0.0)
    assert idx.match(hashes, now=9.0) == {"i-1": 3}
    assert idx.match(hashes, now=11.0) == {}


def test_forget_instance_and_held_counts() -> None:
    idx = PrefixIndex(capacity=100)
    hashes = block_hashes(text(4), SEED)
    idx.insert(hashes[:2], "i-1", now=0.0)
    idx.track("i-1")  # counts what it already holds
    idx.track("i-2")
    idx.insert(hashes, "i-2", now=0.0)
    idx.insert(hashes, "i-2", now=1.0)  # touching again adds nothing
    assert (idx.held("i-1"), idx.held("i-2")) == (2, 4)
    assert idx.match(hashes, now=0.0) == {"i-1": 2, "i-2": 4}
    idx.forget_instance("i-2")
    assert idx.match(hashes, now=0.0) == {"i-1": 2}
    assert (idx.held("i-1"), idx.held("i-2"), len(idx)) == (2, 0, 2)
    idx.forget_instance("i-1")
    assert len(idx) == 0 and idx.held("i-1") == 0
    idx.untrack("i-1")
    idx.insert(hashes, "i-1", now=2.0)  # untracked: not counted (insert pays nothing)
    with pytest.raises(KeyError):
        idx.held("i-1")


def test_lru_bound_keeps_held_counts_exact() -> None:
    idx = PrefixIndex(capacity=5)
    idx.track("i-1")
    idx.track("i-2")
    a, b = block_hashes(text(4, "a"), SEED), block_hashes(text(4, "b"), SEED)
    idx.insert(a, "i-1", now=0.0)
    idx.insert(a, "i-2", now=0.0)
    idx.insert(b, "i-2", now=1.0)  # evicts three of a's tail blocks, held by both
    assert len(idx) == 5
    assert (idx.held("i-1"), idx.held("i-2")) == (1, 5)
    assert idx.match(a, now=1.0) == {"i-1": 1, "i-2": 1}


def test_shrink_drops_the_oldest_chains_tails_first_and_keeps_prefixes() -> None:
    idx = PrefixIndex(capacity=100)
    old, mid, new = (block_hashes(text(4, t), SEED) for t in "omn")
    shared = block_hashes(text(2, "o") + text(2, "s"), SEED)  # shares old's first 2 blocks
    idx.track("i-1")
    idx.insert(old, "i-1", now=0.0)
    idx.insert(mid, "i-1", now=1.0)
    idx.insert(mid, "i-2", now=1.0)
    idx.insert(shared, "i-1", now=2.0)  # touches old's prefix: it is recent now
    idx.insert(new, "i-1", now=9.0)
    assert idx.held("i-1") == 4 + 4 + 2 + 4
    # Old's tail (2 blocks), then mid from its tail; the recent shared prefix survives.
    assert idx.shrink_instance("i-1", 5, before=5.0) == 5
    assert idx.held("i-1") == 9
    assert idx.match(old, now=9.0) == {"i-1": 2}
    assert idx.match(mid, now=9.0) == {"i-1": 1, "i-2": 4}  # i-2's entries untouched
    assert idx.match(new, now=9.0) == {"i-1": 4}
    # Entries given at or after ``before`` are never dropped, even when asked for more.
    assert idx.shrink_instance("i-1", 100, before=5.0) == 5
    assert idx.match(new, now=9.0) == {"i-1": 4}
    assert idx.held("i-1") == 4
    assert idx.shrink_instance("i-1", 0, before=100.0) == 0


def test_seen_prefixes_are_per_tenant_and_prefix_closed() -> None:
    seen = SeenPrefixes(capacity=1000)
    a, b = root_seed("tenant-a"), root_seed("tenant-b")
    system = block_hashes(text(8, "sys"), SEED)
    seen.add(system, a)
    assert seen.depth(system, a) == 8
    assert seen.depth(system, b) == 0  # tenant b never sent it
    longer = block_hashes(text(8, "sys") + text(4, "turn"), SEED)
    assert seen.depth(longer, a) == 8  # the shared system prompt, not the new turn
    seen.add(longer[:3], b)
    assert seen.depth(longer, b) == 3


def test_seen_prefixes_stay_within_their_capacity_under_a_flood() -> None:
    seen = SeenPrefixes(capacity=100)
    for tenant in range(50):
        seen.add(block_hashes(text(10, f"t{tenant}"), SEED), root_seed(f"tenant-{tenant}"))
        assert len(seen) <= 100
    # The newest chain is whole; the oldest is gone.
    assert seen.depth(block_hashes(text(10, "t49"), SEED), root_seed("tenant-49")) == 10
    assert seen.depth(block_hashes(text(10, "t0"), SEED), root_seed("tenant-0")) == 0
