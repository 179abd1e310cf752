"""Approximate, bounded map of which instance holds which prompt prefix in its KV cache.

Prompts are cut into fixed blocks of UTF-8 bytes and each block's hash is chained on the
previous one (like vLLM's block hashes over tokens), so one hash stands for the whole prefix up
to the end of its block: a match of block ``k`` implies the first ``k`` blocks match. The index
learns from the edge's own routing decisions (the winner will hold the prompt after prefill) and
is corrected by engine KV-cache events (``kv_events.py``): a cleared cache forgets the instance,
and an engine holding fewer tokens than the index believes has its least recently used entries
dropped (:meth:`PrefixIndex.shrink_instance`). Memory is bounded by an LRU over block hashes;
entries older than ``ttl_s`` are not trusted, because engines evict cold blocks within minutes.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import xxhash

#: Bytes of rendered prompt per block: ~16 tokens at the documented 4 bytes per token, the
#: size of a vLLM KV block on GPU.
BLOCK_BYTES = 64
#: Documented conversion from rendered prompt bytes to tokens (English text, BPE tokenizers).
BYTES_PER_TOKEN = 4.0

_hash = xxhash.xxh3_64_intdigest
_NEVER = float("-inf")


def root_seed(model: str) -> int:
    """Chain seed per served model (and adapter): caches are not shared across them."""
    return _hash(model.encode())


def block_hashes(data: bytes, seed: int, block_bytes: int = BLOCK_BYTES) -> list[int]:
    """Chained hashes of every full block of ``data`` (a partial tail block is not cached)."""
    out: list[int] = []
    h = seed
    for start in range(0, len(data) - block_bytes + 1, block_bytes):
        h = _hash(data[start : start + block_bytes], seed=h)
        out.append(h)
    return out


class PrefixIndex:
    """Block hash → {instance id: last time seen}, LRU-bounded to ``capacity`` block hashes."""

    __slots__ = ("_entries", "_held", "capacity", "ttl_s")

    def __init__(self, capacity: int = 200_000, ttl_s: float = 600.0) -> None:
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self.capacity = capacity
        self.ttl_s = ttl_s
        self._entries: OrderedDict[int, dict[str, float]] = OrderedDict()
        #: Entries per *tracked* instance (one whose KV events are followed): what the edge
        #: believes that engine holds, in blocks. Untracked instances cost insert nothing.
        self._held: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def match(self, hashes: Sequence[int], now: float) -> dict[str, int]:
        """Number of leading blocks of ``hashes`` each instance holds (instances with >= 1).

        Holdings are prefix-closed (a chain is inserted whole and evicted tail first, as vLLM
        frees a sequence's blocks), so each instance holding the first block is resolved by a
        binary search for its deepest block: O(log n) lookups, one when it holds the whole
        prompt. Entries older than the TTL count as absent.
        """
        entries = self._entries
        n = len(hashes)
        first = entries.get(hashes[0]) if n else None
        if not first:
            return {}
        horizon = now - self.ttl_s
        last = entries.get(hashes[-1]) or {}
        matched: dict[str, int] = {}
        for inst, seen in first.items():
            if seen < horizon:
                continue
            if last.get(inst, _NEVER) >= horizon:
                matched[inst] = n
                continue
            lo, hi = 1, n - 1  # block lo is held, block n is not
            while lo < hi:
                mid = (lo + hi + 1) // 2
                holders = entries.get(hashes[mid - 1])
                if holders is not None and holders.get(inst, _NEVER) >= horizon:
                    lo = mid
                else:
                    hi = mid - 1
            matched[inst] = lo
        return matched

    def insert(self, hashes: Sequence[int], instance: str, now: float) -> None:
        """Record that ``instance`` holds these blocks (most recent use at ``now``).

        Tail first, so that the LRU end holds the tails: eviction shortens a chain from its end
        and what remains is still a prefix.
        """
        entries = self._entries
        held = self._held
        if instance in held:
            added = 0
            for h in reversed(hashes):
                holders = entries.get(h)
                if holders is None:
                    entries[h] = {instance: now}
                    added += 1
                else:
                    if instance not in holders:
                        added += 1
                    holders[instance] = now
                    entries.move_to_end(h)
            held[instance] += added
        else:
            for h in reversed(hashes):
                holders = entries.get(h)
                if holders is None:
                    entries[h] = {instance: now}
                else:
                    holders[instance] = now
                    entries.move_to_end(h)
        while len(entries) > self.capacity:
            for inst in entries.popitem(last=False)[1]:
                if inst in held:
                    held[inst] -= 1

    def track(self, instance: str) -> None:
        """Count ``instance``'s entries from now on (:meth:`held`); one scan to start."""
        if instance not in self._held:
            self._held[instance] = sum(1 for h in self._entries.values() if instance in h)

    def untrack(self, instance: str) -> None:
        self._held.pop(instance, None)

    def held(self, instance: str) -> int:
        """Blocks the index believes a tracked ``instance`` holds (expired entries included);
        ``KeyError`` for an instance not tracked."""
        return self._held[instance]

    def shrink_instance(self, instance: str, blocks: int, before: float) -> int:
        """Drop up to ``blocks`` of ``instance``'s least recently used entries; returns how many.

        The LRU end of the index holds the oldest chains' tails (chains are inserted tail
        first), so what remains of each chain is still a prefix. The scan stops at the first
        entry the instance was given at or after ``before``: newer entries may not be prefilled
        yet, so an engine's count that does not include them yet is no reason to drop them.
        """
        if blocks <= 0:
            return 0
        entries = self._entries
        dropped: list[int] = []
        for h, holders in entries.items():
            seen = holders.get(instance)
            if seen is None:
                continue
            if seen >= before:
                break
            dropped.append(h)
            if len(dropped) == blocks:
                break
        for h in dropped:
            holders = entries[h]
            del holders[instance]
            if not holders:
                del entries[h]
        if dropped and instance in self._held:
            self._held[instance] -= len(dropped)
        return len(dropped)

    def forget_instance(self, instance: str) -> None:
        """Drop every entry of an instance (removed from the table, or its cache cleared)."""
        empty = []
        for h, holders in self._entries.items():
            if holders.pop(instance, None) is not None and not holders:
                empty.append(h)
        for h in empty:
            del self._entries[h]
        if instance in self._held:
            self._held[instance] = 0


class SeenPrefixes:
    """Which prompt prefixes each tenant has sent itself: what a route header may show it.

    The routing index is shared (engines share their caches across tenants unless a cache salt
    separates them), but a tenant told "528 tokens cached" for a prompt it never sent learns
    that another tenant sent it. Keys are a block's chained hash XOR the tenant's salt, so one
    LRU of plain ints bounded to ``capacity`` keys serves every tenant; holdings are prefix-
    closed as in :class:`PrefixIndex` (chains inserted tail first, evicted from the tail).
    """

    __slots__ = ("_keys", "capacity")

    def __init__(self, capacity: int = 200_000) -> None:
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self.capacity = capacity
        self._keys: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._keys)

    def depth(self, hashes: Sequence[int], salt: int) -> int:
        """Leading blocks of ``hashes`` this tenant (``salt``) has sent before."""
        keys = self._keys
        n = len(hashes)
        if not n or (hashes[0] ^ salt) not in keys:
            return 0
        if (hashes[-1] ^ salt) in keys:
            return n
        lo, hi = 1, n - 1  # block lo was sent, block n was not
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if (hashes[mid - 1] ^ salt) in keys:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def add(self, hashes: Sequence[int], salt: int) -> None:
        keys = self._keys
        for h in reversed(hashes):
            k = h ^ salt
            if k in keys:
                keys.move_to_end(k)
            else:
                keys[k] = None
        while len(keys) > self.capacity:
            keys.popitem(last=False)
