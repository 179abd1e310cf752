"""vLLM KV-cache events, consumed by the edge to correct its prefix index.

An engine started with ``--kv-events-config '{"enable_kv_cache_events": true, "publisher":
"zmq", "endpoint": "tcp://*:5557"}'`` publishes ZMQ multipart messages ``[topic, seq, payload]``
(``seq`` 8-byte big-endian from 0; ``payload`` msgpack of a ``KVEventBatch``: ``[ts, events,
data_parallel_rank]``, each event ``BlockStored``, ``BlockRemoved`` or ``AllBlocksCleared``).
The edge subscribes to every table instance that has a ``kv_events_endpoint``.

What the events say is used two ways:

* **Exact prefixes.** For a model whose tokenizer the edge has
  (``regions/engines/prompt_tokens.py``), the edge computes the prompt's block hashes as
  vLLM does (``regions/engines/block_hash.py``) and an instance's cached prefix is the
  longest run of them among the blocks its events say it holds (:meth:`EngineCache.depth`).
  Every edge subscribed to the engine holds the same set.
* **Capacity**, for the byte estimate that remains for models without a tokenizer: the
  resident blocks (stored minus removed, in tokens) are what the engine holds. When the edge
  believes it holds more (its entries times tokens per edge block), the edge's least recently
  used entries for it are dropped until the belief fits (:func:`blocks_to_evict`).

``AllBlocksCleared`` (and an engine restart, seen as ``seq`` starting again at 0) empties the
engine's set and the instance's byte-index entries. A ``seq`` gap (dropped messages) or joining
a running engine makes the set unknown: it is logged and counted, the instance falls back to
the byte estimate, and the next ``AllBlocksCleared`` or restart gives a known state again.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq
import zmq.asyncio
from prometheus_client import CollectorRegistry, Counter, Gauge

from regions.edge.prefix_index import PrefixIndex
from regions.engines.block_hash import event_int
from regions.tables.schema import Instance

log = logging.getLogger("fedinfer.edge.kv_events")

#: Entries the edge recorded this recently are never dropped by a capacity correction: the
#: engine may not have prefilled (and reported) them yet.
SETTLE_S = 2.0
#: How often the capacity check runs when no event arrives (entries settle meanwhile).
CHECK_INTERVAL_S = 0.5
#: Media whose blocks are in the engine's GPU prefix cache (``None``: not said).
_GPU_MEDIA = (None, "GPU")
#: Resident blocks one engine may report (an H100's 80 GB holds a few hundred thousand blocks
#: of 16 tokens): past this the set stops being trusted rather than growing without bound.
MAX_RESIDENT_BLOCKS = 1 << 22


class EventFormatError(ValueError):
    """A payload that is not a vLLM ``KVEventBatch``."""


@dataclass(frozen=True, slots=True)
class Stored:
    hashes: tuple[Hashable, ...]
    block_size: int
    medium: str | None


@dataclass(frozen=True, slots=True)
class Removed:
    hashes: tuple[Hashable, ...]
    medium: str | None


@dataclass(frozen=True, slots=True)
class Cleared:
    pass


Event = Stored | Removed | Cleared


@dataclass(frozen=True, slots=True)
class Batch:
    ts: float
    events: tuple[Event, ...]
    data_parallel_rank: int | None = None


def _hashes(value: Any) -> tuple[Hashable, ...]:
    """Event hashes as ints: vLLM sends the last 8 bytes as an int by default, the whole
    digest as bytes under ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``; both become the int."""
    if not isinstance(value, list):
        raise EventFormatError("block_hashes must be a list of ints or bytes")
    out: list[Hashable] = []
    for h in value:
        if isinstance(h, bytes):
            out.append(event_int(h))
        elif isinstance(h, int) and not isinstance(h, bool):
            out.append(h)
        else:
            raise EventFormatError("block_hashes must be a list of ints or bytes")
    return tuple(out)


def _event(raw: Any) -> Event | None:
    """One event: a map tagged by ``type`` (vLLM 0.32) or an array ``[tag, fields...]``
    (releases whose events were ``array_like``); None for an event type not known here."""
    if isinstance(raw, dict):
        tag = raw.get("type")
        if tag == "BlockStored":
            size = raw.get("block_size")
            if not isinstance(size, int) or size < 1:
                raise EventFormatError("BlockStored without a block_size")
            return Stored(_hashes(raw.get("block_hashes")), size, raw.get("medium"))
        if tag == "BlockRemoved":
            return Removed(_hashes(raw.get("block_hashes")), raw.get("medium"))
    elif isinstance(raw, list) and raw:
        tag = raw[0]
        if tag == "BlockStored" and len(raw) >= 5:
            if not isinstance(raw[4], int) or raw[4] < 1:
                raise EventFormatError("BlockStored without a block_size")
            return Stored(_hashes(raw[1]), raw[4], raw[6] if len(raw) > 6 else None)
        if tag == "BlockRemoved" and len(raw) >= 2:
            return Removed(_hashes(raw[1]), raw[2] if len(raw) > 2 else None)
    else:
        raise EventFormatError(f"an event must be a map or an array, not {type(raw).__name__}")
    if tag == "AllBlocksCleared":
        return Cleared()
    if tag in ("BlockStored", "BlockRemoved"):
        raise EventFormatError(f"malformed {tag}")
    return None


def decode_batch(payload: bytes) -> Batch:
    """Decode a ``KVEventBatch`` payload; :class:`EventFormatError` when it is not one.

    Decoded from plain msgpack rather than into vLLM's Structs, so fields added by later
    releases (they are appended, with defaults) and unknown event types are skipped.
    """
    try:
        raw = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError as exc:
        raise EventFormatError(f"not msgpack: {exc}") from None
    if isinstance(raw, list) and len(raw) >= 2:
        ts, events, rank = raw[0], raw[1], raw[2] if len(raw) > 2 else None
    elif isinstance(raw, dict):
        ts, events, rank = raw.get("ts"), raw.get("events"), raw.get("data_parallel_rank")
    else:
        raise EventFormatError("a batch must be [ts, events, ...]")
    if not isinstance(ts, int | float) or not isinstance(events, list):
        raise EventFormatError("a batch must be [ts, events, ...]")
    parsed = tuple(e for e in map(_event, events) if e is not None)
    return Batch(float(ts), parsed, rank if isinstance(rank, int) else None)


def blocks_to_evict(believed_blocks: int, block_tokens: float, engine_tokens: int) -> int:
    """Edge entries to drop so that ``believed_blocks * block_tokens <= engine_tokens``."""
    excess = believed_blocks * block_tokens - engine_tokens
    return 0 if excess <= 0 else min(believed_blocks, math.ceil(excess / block_tokens - 1e-9))


@dataclass
class EngineCache:
    """What one engine's GPU prefix cache holds, according to its events.

    Resident blocks are a set of hashes (with their tokens), so a block reported stored twice
    — vLLM's ``kv_cache_report_mode="full"`` reports reused blocks again — counts once.
    ``known`` is False until the stream is seen from a known state: from ``seq`` 0, or since
    an ``AllBlocksCleared``.
    """

    blocks: dict[Hashable, int] = field(default_factory=dict)
    tokens: int = 0
    known: bool = False
    next_seq: int | None = None
    #: The engine's block size in tokens, from its latest ``BlockStored`` (None: none yet).
    block_size: int | None = None

    def depth(self, hashes: Iterable[Hashable]) -> int:
        """How many leading ``hashes`` the engine holds: its cached prefix, in blocks, as
        vLLM's lookup stops at the first block it does not hold."""
        blocks = self.blocks
        n = 0
        for h in hashes:
            if h not in blocks:
                break
            n += 1
        return n

    def receive(self, seq: int, batch: Batch) -> tuple[bool, bool]:
        """Apply one message; returns ``(cleared, gap)``: the engine's cache was emptied (a
        clear or a restart), messages were missed (the count is unknown from here)."""
        cleared = gap = False
        expected = self.next_seq
        if expected is None:
            self.known = seq == 0  # joined at the start, or late with blocks unknown
        elif seq < expected:
            # seq starts again: a new engine process, with an empty cache.
            self._empty()
            cleared = True
            self.known = seq == 0
            gap = seq != 0
        elif seq > expected:
            self.known = False
            gap = True
        self.next_seq = seq + 1
        for event in batch.events:
            if isinstance(event, Cleared):
                self._empty()
                self.known = True
                cleared = True
            elif event.medium not in _GPU_MEDIA:
                continue  # an offload tier: not in the GPU prefix cache
            elif isinstance(event, Stored):
                self.block_size = event.block_size
                for h in event.hashes:
                    if h not in self.blocks:
                        self.blocks[h] = event.block_size
                        self.tokens += event.block_size
                if len(self.blocks) > MAX_RESIDENT_BLOCKS:
                    self._empty()
                    self.known = False
                    gap = True
            else:
                for h in event.hashes:
                    self.tokens -= self.blocks.pop(h, 0)
        return cleared, gap

    def _empty(self) -> None:
        self.blocks.clear()
        self.tokens = 0


class KvEventMetrics:
    """The subscribers' series, in the edge's registry."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.batches = Counter(
            "fedinfer_edge_kv_event_batches",
            "KV-event batches received per instance",
            ["instance"],
            registry=registry,
        )
        self.gaps = Counter(
            "fedinfer_edge_kv_event_gaps",
            "KV-event sequence gaps (missed batches) per instance",
            ["instance"],
            registry=registry,
        )
        self.evicted = Counter(
            "fedinfer_edge_kv_event_evicted_blocks",
            "Prefix-index entries dropped because the engine holds fewer tokens",
            ["instance"],
            registry=registry,
        )
        self.engine_tokens = Gauge(
            "fedinfer_edge_kv_engine_cached_tokens",
            "Tokens in the engine's prefix cache per its KV events (-1: unknown)",
            ["instance"],
            registry=registry,
        )


class KvEventSubscriber:
    """Subscribes to one instance's events and corrects the prefix index with them."""

    def __init__(
        self,
        instance: str,
        endpoint: str,
        index: PrefixIndex,
        block_tokens: float,
        metrics: KvEventMetrics,
    ) -> None:
        self.instance = instance
        self.endpoint = endpoint
        self.index = index
        self.block_tokens = block_tokens
        self.metrics = metrics
        self.cache = EngineCache()

    async def run(self, context: zmq.asyncio.Context) -> None:
        sock = context.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SUBSCRIBE, b"")  # every topic: the table does not name one
        sock.connect(self.endpoint)
        try:
            while True:
                if await sock.poll(int(CHECK_INTERVAL_S * 1000)):
                    self.receive(await sock.recv_multipart())
                self.fit(time.monotonic())
        finally:
            sock.close()

    def receive(self, frames: list[bytes]) -> None:
        """Apply one ``[topic, seq, payload]`` message (a malformed one is logged, skipped)."""
        if len(frames) != 3 or len(frames[1]) != 8:
            log.warning("kv events %s: not [topic, seq, payload], skipped", self.instance)
            return
        try:
            batch = decode_batch(frames[2])
        except EventFormatError as exc:
            log.warning("kv events %s: bad payload, skipped: %s", self.instance, exc)
            return
        seq = int.from_bytes(frames[1], "big")
        cleared, gap = self.cache.receive(seq, batch)
        self.metrics.batches.labels(self.instance).inc()
        if gap:
            self.metrics.gaps.labels(self.instance).inc()
            log.warning(
                "kv events %s: sequence gap at %d; cache size unknown until it is cleared",
                self.instance,
                seq,
            )
        if cleared:
            self.index.forget_instance(self.instance)
        self.metrics.engine_tokens.labels(self.instance).set(
            self.cache.tokens if self.cache.known else -1
        )

    def fit(self, now: float) -> int:
        """Drop the index's oldest entries for the instance beyond what the engine holds."""
        if not self.cache.known:
            return 0
        n = blocks_to_evict(self.index.held(self.instance), self.block_tokens, self.cache.tokens)
        dropped = self.index.shrink_instance(self.instance, n, before=now - SETTLE_S) if n else 0
        if dropped:
            self.metrics.evicted.labels(self.instance).inc(dropped)
        return dropped


class KvEventHub:
    """One subscriber task per table instance with a ``kv_events_endpoint``."""

    def __init__(self, index: PrefixIndex, block_tokens: float, registry: CollectorRegistry):
        self.index = index
        self.block_tokens = block_tokens
        self.metrics = KvEventMetrics(registry)
        self._wanted: dict[str, str] = {}
        self._tasks: dict[str, tuple[str, asyncio.Task[None]]] = {}
        #: What each followed engine holds, by instance id (read by placement).
        self.caches: dict[str, EngineCache] = {}
        self._ctx: zmq.asyncio.Context | None = None

    def known(self, instance: str) -> EngineCache | None:
        """The instance's cache when its events were followed from a known state, else None
        (no events, a gap, a late join): the caller falls back to the byte estimate."""
        cache = self.caches.get(instance)
        return cache if cache is not None and cache.known else None

    def sync(self, instances: Iterable[Instance]) -> None:
        """Follow the table: subscribe to new endpoints, drop the ones gone (no await)."""
        wanted = {i.id: i.kv_events_endpoint for i in instances if i.kv_events_endpoint}
        for inst in self._wanted.keys() - wanted.keys():
            self.index.untrack(inst)
        for inst in wanted:
            self.index.track(inst)
        self._wanted = wanted
        if self._ctx is not None:
            self._reconcile()

    def start(self) -> None:
        self._ctx = zmq.asyncio.Context()
        self._reconcile()

    def _reconcile(self) -> None:
        assert self._ctx is not None
        for inst, (endpoint, task) in list(self._tasks.items()):
            if self._wanted.get(inst) != endpoint:
                task.cancel()
                del self._tasks[inst]
                self.caches.pop(inst, None)
        for inst, endpoint in self._wanted.items():
            if inst not in self._tasks:
                sub = KvEventSubscriber(inst, endpoint, self.index, self.block_tokens, self.metrics)
                self.caches[inst] = sub.cache
                task = asyncio.create_task(self._guard(sub, self._ctx))
                self._tasks[inst] = (endpoint, task)

    async def _guard(self, sub: KvEventSubscriber, context: zmq.asyncio.Context) -> None:
        """Run a subscriber; a failure (bad endpoint) is logged, not raised into the edge."""
        try:
            await sub.run(context)
        except asyncio.CancelledError:
            raise
        except Exception:
            sub.cache.known = False  # no longer followed: not to be trusted for lookups
            log.exception("kv events %s (%s): subscriber stopped", sub.instance, sub.endpoint)

    async def stop(self) -> None:
        tasks = [task for _, task in self._tasks.values()]
        self._tasks = {}
        self.caches = {}
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._ctx is not None:
            self._ctx.destroy(linger=0)  # closes sockets of tasks cancelled by a table change
            self._ctx = None
