"""Paged KV cache: chained block hashes, prefix hits, LRU eviction, all-or-nothing allocation."""

from __future__ import annotations

import pytest

from regions.engines.simulator.kv_cache import (
    KVCacheManager,
    extend_block_hashes,
    hash_block_tokens,
    root_hash,
)

BS = 16
ROOT = root_hash(0)


def hashes(tokens: list[int], extra: bytes = b"") -> list[int]:
    out: list[int] = []
    extend_block_hashes(out, tokens, BS, ROOT, extra)
    return out


def test_hashes_are_chained_over_full_blocks_only() -> None:
    tokens = list(range(40))  # two full blocks and a partial one
    h = hashes(tokens)
    assert len(h) == 2
    assert h[0] == hash_block_tokens(ROOT, tokens[:16])
    assert h[1] == hash_block_tokens(h[0], tokens[16:32])


def test_a_block_hash_identifies_the_whole_prefix() -> None:
    a = list(range(48))
    b = [999, *a[1:]]  # differs only in the first token
    ha, hb = hashes(a), hashes(b)
    assert all(x != y for x, y in zip(ha, hb, strict=True))  # every later block differs too
    # Same block content under a different parent is a different block.
    assert hash_block_tokens(ha[0], a[16:32]) != hash_block_tokens(hb[0], a[16:32])


def test_incremental_extension_equals_one_shot_and_extra_keys_separate() -> None:
    tokens = list(range(100))
    inc: list[int] = []
    for end in range(0, 101, 7):
        extend_block_hashes(inc, tokens[:end], BS, ROOT)
    assert inc == hashes(tokens)
    assert hashes(tokens, b"sql-lora") != hashes(tokens)  # LoRA adapters do not share KV
    assert root_hash(1) != ROOT


def fill(kv: KVCacheManager, tokens: list[int]) -> list[int]:
    """Compute a whole sequence the way the scheduler does; returns its block ids."""
    blocks: list[int] = []
    hit = kv.find_cached_prefix(hashes(tokens), len(tokens))
    assert kv.allocate(blocks, 0, len(tokens) - len(hit) * BS, hit)
    kv.cache_full_blocks(blocks, hashes(tokens), len(hit), len(tokens) // BS)
    return blocks


def test_repeated_prompt_hits_all_full_blocks_but_the_last_token() -> None:
    kv = KVCacheManager(num_blocks=64, block_size=BS)
    prompt = list(range(100))  # 6 full blocks + 4 tokens
    blocks = fill(kv, prompt)
    kv.free_blocks(blocks)
    assert kv.find_cached_prefix(hashes(prompt), len(prompt)) != []
    assert len(kv.find_cached_prefix(hashes(prompt), len(prompt))) == 6
    exact = list(range(96))  # 6 full blocks exactly: the last token must be computed
    assert len(kv.find_cached_prefix(hashes(exact), len(exact))) == 5
    other = [7, *prompt[1:]]
    assert kv.find_cached_prefix(hashes(other), len(other)) == []


def test_hit_blocks_leave_the_free_queue_and_are_shared() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    prompt = list(range(64))
    first = fill(kv, prompt)
    second = fill(kv, prompt)  # while the first still holds its blocks
    assert second[:3] == first[:3]  # shared prefix blocks
    assert kv.ref_cnt[first[0]] == 2
    kv.free_blocks(first)
    kv.free_blocks(second)
    assert kv.num_free_blocks == 16
    assert kv.usage == 0.0


def test_lru_eviction_takes_least_recently_freed_and_tail_blocks_first() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    a = list(range(1000, 1064))  # 4 blocks
    b = list(range(2000, 2064))  # 4 blocks
    blocks_a = fill(kv, a)
    kv.free_blocks(list(blocks_a))  # free_blocks empties the list it is given
    blocks_b = fill(kv, b)
    kv.free_blocks(list(blocks_b))
    # Need 2 fresh blocks: both come from A (freed earlier), its tail first.
    fresh: list[int] = []
    assert kv.allocate(fresh, 0, 32)
    assert fresh == [blocks_a[3], blocks_a[2]]
    assert len(kv.find_cached_prefix(hashes(a), 65)) == 2  # A's head survives
    assert len(kv.find_cached_prefix(hashes(b), 65)) == 4  # B untouched
    assert kv.evictions == 2


def test_allocation_is_all_or_nothing() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    blocks: list[int] = []
    assert not kv.allocate(blocks, 0, 5 * BS)
    assert blocks == [] and kv.num_free_blocks == 4
    assert kv.allocate(blocks, 0, 4 * BS)
    assert kv.usage == 1.0
    assert not kv.allocate(blocks, 4 * BS, 1)  # growing past the end fails cleanly
    assert len(blocks) == 4


def test_growing_a_sequence_allocates_only_when_a_block_fills() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    blocks: list[int] = []
    assert kv.allocate(blocks, 0, 10)
    assert len(blocks) == 1
    for computed in range(10, 16):
        assert kv.allocate(blocks, computed, 1)
    assert len(blocks) == 1
    assert kv.allocate(blocks, 16, 1)
    assert len(blocks) == 2


def test_touching_cached_free_blocks_counts_against_capacity() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    prompt = list(range(48))  # 3 blocks
    kv.free_blocks(fill(kv, prompt))
    hit = kv.find_cached_prefix(hashes(prompt), len(prompt) + 1)
    assert len(hit) == 3
    blocks: list[int] = []
    # 3 hit blocks are free-but-cached; 2 more fresh blocks would need 5 in total.
    assert not kv.allocate(blocks, 0, 2 * BS, hit)
    assert kv.allocate(blocks, 0, BS, hit)
    assert kv.num_free_blocks == 0


def test_caching_can_be_disabled_and_bad_sizes_are_refused() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BS, enable_caching=False)
    prompt = list(range(64))
    kv.free_blocks(fill(kv, prompt))
    assert kv.find_cached_prefix(hashes(prompt), len(prompt)) == []
    with pytest.raises(ValueError):
        KVCacheManager(num_blocks=0)


def test_reset_prefix_cache_only_when_idle() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    prompt = list(range(64))
    blocks = fill(kv, prompt)
    assert not kv.reset_prefix_cache()
    kv.free_blocks(blocks)
    assert kv.reset_prefix_cache()
    assert kv.find_cached_prefix(hashes(prompt), len(prompt)) == []
