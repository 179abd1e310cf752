"""Paged KV cache with automatic prefix caching, after vLLM v1's ``BlockPool`` and
``KVCacheManager`` (``vllm/v1/core/block_pool.py``, ``kv_cache_utils.py``).

* The cache is ``num_blocks`` blocks of ``block_size`` tokens; a request holds a list of blocks.
* A *full* block is identified by a chained hash: ``hash(parent_hash, block_tokens, extra)``
  (vLLM's ``hash_block_tokens``), so equal hashes mean equal whole prefixes. ``extra`` carries
  the LoRA adapter name, which keeps adapters' caches apart, as vLLM's extra keys do.
* Blocks whose reference count drops to zero go to the tail of a free queue but keep their
  hash: they can still be hit. Allocation takes the queue head, i.e. evicts the least recently
  freed block first (LRU). A request frees its blocks tail first, so the end of a prompt is
  evicted before its shared beginning.
* A lookup never covers the last prompt token (it must be computed to sample from), so at most
  ``(num_tokens - 1) // block_size`` blocks hit.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Protocol

import xxhash

_hash = xxhash.xxh3_64_intdigest


def root_hash(seed: int) -> int:
    """The parent hash of a first block (vLLM's ``NONE_HASH``), fixed by the engine seed."""
    return _hash(b"fedinfer-sim-none-hash" + seed.to_bytes(8, "little", signed=True))


def hash_block_tokens(parent: int, block_tokens: Sequence[int], extra: bytes = b"") -> int:
    """Chained hash of one full block: parent hash, the block's token ids, extra keys."""
    return _hash(parent.to_bytes(8, "little") + array("I", block_tokens).tobytes() + extra)


def extend_block_hashes(
    hashes: list[int],
    token_ids: Sequence[int],
    block_size: int,
    root: int,
    extra: bytes = b"",
) -> None:
    """Append the hashes of the full blocks of ``token_ids`` not yet in ``hashes``."""
    start = len(hashes)
    end = len(token_ids) // block_size
    if end <= start:
        return
    data = array("I", token_ids[start * block_size : end * block_size]).tobytes()
    step = block_size * 4
    parent = hashes[-1] if hashes else root
    for i in range(end - start):
        parent = _hash(parent.to_bytes(8, "little") + data[i * step : (i + 1) * step] + extra)
        hashes.append(parent)


class KVEventListener(Protocol):
    """Told what vLLM reports as KV-cache events (``kv_events.py`` publishes them)."""

    def stored(
        self,
        block_hashes: Sequence[int],
        parent: int | None,
        token_ids: Sequence[int],
        block_size: int,
        lora: str | None,
    ) -> None: ...

    def removed(self, block_hash: int) -> None: ...

    def cleared(self) -> None: ...


class KVCacheManager:
    """Block allocation, prefix-cache lookup and LRU eviction for one engine."""

    def __init__(self, num_blocks: int, block_size: int = 16, enable_caching: bool = True):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        # Free blocks in eviction order (head = least recently freed). Cached blocks with no
        # reference stay here, still findable through ``cached``.
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached: dict[int, int] = {}  # block hash -> block id
        self.evictions = 0
        #: Where block stored/removed/cleared events go (vLLM's ``enable_kv_cache_events``).
        self.listener: KVEventListener | None = None

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by requests (vLLM's ``kv_cache_usage_perc``)."""
        return 1.0 - len(self.free) / self.num_blocks

    def find_cached_prefix(self, block_hashes: Sequence[int], num_tokens: int) -> list[int]:
        """Ids of the longest run of cached blocks from the start of the sequence."""
        if not self.enable_caching:
            return []
        limit = min(len(block_hashes), (num_tokens - 1) // self.block_size)
        hit: list[int] = []
        cached = self.cached
        for i in range(limit):
            block = cached.get(block_hashes[i])
            if block is None:
                break
            hit.append(block)
        return hit

    def allocate(
        self,
        block_ids: list[int],
        num_computed_tokens: int,
        num_new_tokens: int,
        new_computed_blocks: Sequence[int] = (),
    ) -> bool:
        """Give a request (its ``block_ids``, extended in place) room for ``num_new_tokens``
        more tokens after ``num_computed_tokens`` plus the prefix-hit ``new_computed_blocks``.
        Returns False, changing nothing, when there are not enough free blocks."""
        bs = self.block_size
        total_tokens = num_computed_tokens + len(new_computed_blocks) * bs + num_new_tokens
        needed = -(-total_tokens // bs) - len(block_ids) - len(new_computed_blocks)
        ref = self.ref_cnt
        # Hit blocks nobody references sit in the free queue; touching them takes them out.
        touched_free = sum(1 for b in new_computed_blocks if ref[b] == 0)
        if needed > len(self.free) - touched_free:
            return False
        free = self.free
        for b in new_computed_blocks:
            if ref[b] == 0:
                del free[b]
            ref[b] += 1
        block_ids.extend(new_computed_blocks)
        for _ in range(max(needed, 0)):
            b, _ = free.popitem(last=False)
            self._evict(b)
            ref[b] = 1
            block_ids.append(b)
        return True

    def _evict(self, block: int) -> None:
        h = self.block_hash[block]
        if h is not None:
            if self.cached.get(h) == block:
                del self.cached[h]
            self.block_hash[block] = None
            self.evictions += 1
            if self.listener is not None:
                self.listener.removed(h)

    def cache_full_blocks(
        self,
        block_ids: Sequence[int],
        block_hashes: Sequence[int],
        start: int,
        end: int,
        token_ids: Callable[[], Sequence[int]] | None = None,
        lora: str | None = None,
    ) -> int:
        """Register blocks ``start..end-1`` (now full and computed) under their hashes; returns
        the new count of registered blocks. A hash already cached keeps its first block.
        ``token_ids`` (the sequence's tokens, only read when a listener wants them) and ``lora``
        describe the blocks in the stored event."""
        if not self.enable_caching:
            return end
        end = min(end, len(block_hashes), len(block_ids))
        stored: list[int] = []
        for i in range(start, end):
            b = block_ids[i]
            if self.block_hash[b] is None:
                h = block_hashes[i]
                self.block_hash[b] = h
                self.cached.setdefault(h, b)
                stored.append(h)
        if stored and self.listener is not None:
            bs = self.block_size
            tokens = token_ids()[start * bs : end * bs] if token_ids is not None else ()
            parent = block_hashes[start - 1] if start > 0 else None
            self.listener.stored(stored, parent, tokens, bs, lora)
        return max(start, end)

    def free_blocks(self, block_ids: list[int]) -> None:
        """Drop a request's references, tail first; unreferenced blocks join the free queue's
        tail (most recently used) with their hashes, ready to be hit again."""
        ref = self.ref_cnt
        free = self.free
        for b in reversed(block_ids):
            ref[b] -= 1
            if ref[b] == 0:
                free[b] = None
        block_ids.clear()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash (vLLM's ``/reset_prefix_cache``); only when all blocks are
        free, as vLLM requires."""
        if len(self.free) != self.num_blocks:
            return False
        self.cached.clear()
        self.block_hash = [None] * self.num_blocks
        if self.listener is not None:
            self.listener.cleared()
        return True
