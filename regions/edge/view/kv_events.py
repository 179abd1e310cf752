"""vLLM KV-cache events, consumed by the edge to correct its prefix index.

An engine started with ``--kv-events-config '{"enable_kv_cache_events": true, "publisher":
"zmq", "endpoint": "tcp://[::ffff:ENGINE_IP]:5557"}'`` (bound on the engine's own address: vLLM
binds an endpoint with ``*`` or ``::``, and libzmq binds an IPv4-mapped address as the IPv4
one) publishes ZMQ multipart messages ``[topic, seq, payload]``
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

The publisher is not authenticated (ZMQ PUB/SUB; the network keeps others away), so what a
message may cost is bounded whatever it says: sizes, frames, events and hashes are checked
from headers before decoding (``kv_event_format.py``), a batch is checked whole before any of it is
applied, the work is done on the event loop in slices (:func:`in_slices`), and a refused
message is counted by reason (``fedinfer_edge_kv_event_refused_total``) and applies nothing.
What arrives on an endpoint only ever concerns the one instance the table gives it.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Generator, Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import zmq
import zmq.asyncio
from prometheus_client import CollectorRegistry, Counter, Gauge

from regions.edge.policy.kv_event_format import (
    FRAMES,
    MAX_PAYLOAD_BYTES,
    Batch,
    Cleared,
    EventFormatError,
    Removed,
    Stored,
    check_frames,
    decode_steps,
    run_steps,
)
from regions.edge.policy.prefix_index import PrefixIndex
from regions.tables.schema import Instance

log = logging.getLogger("fedinfer.edge.kv_events")
_T = TypeVar("_T")

#: Entries the edge recorded this recently are never dropped by a capacity correction: the
#: engine may not have prefilled (and reported) them yet.
SETTLE_S = 2.0
#: How often the capacity check runs when no event arrives (entries settle meanwhile).
CHECK_INTERVAL_S = 0.5
#: The prefix index is scanned for one instance (a clear forgets its entries, the capacity
#: check drops its oldest) at most this often, however fast its events come.
INDEX_SCAN_INTERVAL_S = CHECK_INTERVAL_S
#: Media whose blocks are in the engine's GPU prefix cache (``None``: not said).
_GPU_MEDIA = (None, "GPU")
#: Resident blocks one engine may report (an H100's 80 GB holds a few hundred thousand blocks
#: of 16 tokens): past this the set stops being trusted rather than growing without bound.
MAX_RESIDENT_BLOCKS = 1 << 22
#: Hashes applied between returns to the event loop (an event may be applied in parts: the
#: whole batch was checked before the first part).
_APPLY_CHUNK = 2048


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
    #: ``BlockStored`` events refused because they would pass :data:`MAX_RESIDENT_BLOCKS`.
    overflows: int = 0

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
        return run_steps(self.receive_steps(seq, batch))

    def receive_steps(self, seq: int, batch: Batch) -> Generator[None, None, tuple[bool, bool]]:
        """:meth:`receive`, yielding between events (and within large ones)."""
        cleared, gap = self._sequence(seq)
        for event in batch.events:
            if isinstance(event, Cleared):
                self._empty()
                self.known = True
                cleared = True
            elif event.medium not in _GPU_MEDIA:
                continue  # an offload tier: not in the GPU prefix cache
            elif isinstance(event, Stored):
                gap = not (yield from self._store(event)) or gap
            else:
                yield from self._remove(event)
            yield
        return cleared, gap

    def _sequence(self, seq: int) -> tuple[bool, bool]:
        """Follow ``seq``: ``(cleared, gap)`` for a restart or missed messages."""
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
        return cleared, gap

    def _store(self, event: Stored) -> Generator[None, None, bool]:
        """Add the event's blocks; False (nothing added, the set emptied and unknown) when
        they would take it past :data:`MAX_RESIDENT_BLOCKS`, checked before the first."""
        blocks = self.blocks
        new = {h for h in event.hashes if h not in blocks}
        if len(blocks) + len(new) > MAX_RESIDENT_BLOCKS:
            self._empty()  # more than any engine holds: not to be trusted
            self.known = False
            self.overflows += 1
            return False
        self.block_size = event.block_size
        for n, h in enumerate(new, 1):
            blocks[h] = event.block_size
            self.tokens += event.block_size
            if n % _APPLY_CHUNK == 0:
                yield
        return True

    def _remove(self, event: Removed) -> Generator[None, None, None]:
        for n, h in enumerate(event.hashes, 1):
            self.tokens -= self.blocks.pop(h, 0)
            if n % _APPLY_CHUNK == 0:
                yield

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
        self.refused = Counter(
            "fedinfer_edge_kv_event_refused",
            "KV-event messages refused whole (malformed or over a cap), by reason",
            ["instance", "reason"],
            registry=registry,
        )
        self.disconnects = Counter(
            "fedinfer_edge_kv_event_disconnects",
            "Connections to the KV-event publisher lost, among them those libzmq drops for a "
            "frame over the size cap (ZMQ_MAXMSGSIZE); it reconnects",
            ["instance"],
            registry=registry,
        )
        self.throttled = Counter(
            "fedinfer_edge_kv_event_throttled",
            "Times a subscription stopped reading for the rest of a window: its messages took "
            "more than its share of the event loop",
            ["instance"],
            registry=registry,
        )
        self.shared_endpoints = Gauge(
            "fedinfer_edge_kv_event_shared_endpoints",
            "Table instances not followed because another instance names the same endpoint",
            registry=registry,
        )


#: Work one subscriber does on the event loop before it lets other tasks run.
SLICE_S = 0.002
#: Frames drained from an over-long message between returns to the event loop.
_DRAIN_CHUNK = 1024
#: Waits before a new connection after a lost one (:meth:`KvEventSubscriber.run`).
RECONNECT_MIN_S = 0.1
RECONNECT_MAX_S = 5.0
#: Messages one subscriber may have queued by libzmq (``ZMQ_RCVHWM``; past it the publisher
#: drops, and the edge sees a gap): with :data:`MAX_PAYLOAD_BYTES`, what a publisher can make
#: an edge hold. Not bounded by libzmq: the frames of one multipart message, which it buffers
#: whole before delivering any (a publisher sending one endless message grows the edge's
#: memory); only the network policy keeps such a publisher away.
RCV_HWM = 128


def read_steps(sock: zmq.Socket[bytes]) -> Generator[None, None, tuple[list[bytes], int]]:
    """Read one message that is ready (libzmq delivers a message's frames together): its
    first :data:`FRAMES` frames and how many it had; the rest are drained unkept, yielding
    every :data:`_DRAIN_CHUNK` frames."""
    frames: list[bytes] = []
    count = 0
    while True:
        try:
            frame = sock.recv(zmq.NOBLOCK)
        except zmq.Again:  # the poll's readiness was stale: no message after all
            if count:
                raise  # never: libzmq delivers a message's frames together
            return frames, 0
        count += 1
        if len(frames) < FRAMES:
            frames.append(frame)
        if not sock.getsockopt(zmq.RCVMORE):
            return frames, count
        if count % _DRAIN_CHUNK == 0:
            yield


#: Share of the event loop one subscription may take over a window: past it, its socket is
#: not read until the window ends (libzmq then holds at most :data:`RCV_HWM` messages and the
#: publisher drops the rest, which the edge sees as a gap). vLLM's events take a small
#: fraction of this; a flood of messages, however small, costs no more.
LOOP_SHARE = 0.1
BUDGET_WINDOW_S = 1.0


@dataclass
class LoopBudget:
    """Event-loop time one subscription spent in the current window (pure bookkeeping)."""

    share: float = LOOP_SHARE
    window_s: float = BUDGET_WINDOW_S
    start: float = -math.inf
    spent: float = 0.0

    def charge(self, seconds: float, now: float) -> None:
        if now - self.start >= self.window_s:
            self.start, self.spent = now, 0.0
        self.spent += seconds

    def pause(self, now: float) -> float:
        """Seconds to stop reading for: 0 within the share, else to the window's end."""
        if self.spent <= self.share * self.window_s or now - self.start >= self.window_s:
            return 0.0
        return self.start + self.window_s - now


async def in_slices(steps: Generator[None, None, _T], budget: LoopBudget | None = None) -> _T:
    """Run a step generator on the event loop, giving way after every :data:`SLICE_S`; the
    time spent in its steps is charged to ``budget``."""
    started = time.monotonic()
    deadline = started + SLICE_S
    while True:
        try:
            next(steps)
        except StopIteration as stop:
            if budget is not None:
                now = time.monotonic()
                budget.charge(now - started, now)
            return stop.value  # type: ignore[no-any-return]
        now = time.monotonic()
        if now >= deadline:
            if budget is not None:
                budget.charge(now - started, now)
            await asyncio.sleep(0)
            started = time.monotonic()
            deadline = started + SLICE_S


class KvEventSubscriber:
    """Subscribes to one instance's events and corrects the prefix index with them.

    What the messages say only ever concerns this instance (the table maps the endpoint to
    it; a message names no instance). Every message is bounded before it costs anything:
    frame sizes by libzmq (``ZMQ_MAXMSGSIZE``) and again here, frames, events and hashes from
    their headers before decoding; it is decoded and applied on the event loop in slices of
    :data:`SLICE_S`, checked whole before any of it is applied. A refused message is counted
    by reason and makes the engine's set unknown (the byte estimate takes over).
    """

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
        #: Messages applied so far (a connection that delivered one resets the backoff).
        self.accepted = 0
        self.budget = LoopBudget()
        self._refusals: dict[str, int] = {}
        self._gaps = 0
        self._forget_due = False
        self._scanned_at = -math.inf

    async def run(self, context: zmq.asyncio.Context) -> None:
        """Follow the endpoint; after a lost connection, a new socket after a backoff.

        libzmq reconnects by itself after a connection error, but not after a protocol error
        such as a frame over ``ZMQ_MAXMSGSIZE``: that endpoint would stay silent for good.
        So any disconnect ends the socket here and a new one connects, after
        :data:`RECONNECT_MIN_S`, doubling to :data:`RECONNECT_MAX_S` while no message is
        accepted in between (a publisher that keeps sending oversized frames costs a
        connection attempt every few seconds).
        """
        backoff = RECONNECT_MIN_S
        while True:
            accepted = self.accepted
            await self._follow(context)
            self.metrics.disconnects.labels(self.instance).inc()
            backoff = RECONNECT_MIN_S if self.accepted != accepted else backoff
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, RECONNECT_MAX_S)

    async def _follow(self, context: zmq.asyncio.Context) -> None:
        """Receive on one SUB socket until its connection is lost (the monitor says so);
        what was already received is applied first."""
        sock = context.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_PAYLOAD_BYTES)
        sock.setsockopt(zmq.RCVHWM, RCV_HWM)
        sock.setsockopt(zmq.SUBSCRIBE, b"")  # every topic: the table does not name one
        monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        reader: zmq.Socket[bytes] = zmq.Socket.shadow(sock.underlying)
        poller = zmq.asyncio.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        sock.connect(self.endpoint)
        try:
            while True:
                ready = dict(await poller.poll(int(CHECK_INTERVAL_S * 1000)))
                lost = monitor in ready
                while sock in ready or (lost and reader.poll(0)):
                    frames, count = await in_slices(read_steps(reader), self.budget)
                    await in_slices(self.receive_steps(frames, count), self.budget)
                    ready.pop(sock, None)
                    if pause := self.budget.pause(time.monotonic()):
                        self.metrics.throttled.labels(self.instance).inc()
                        await asyncio.sleep(pause)
                self.maintain(time.monotonic())
                if lost:
                    return
        finally:
            sock.disable_monitor()
            monitor.close()
            sock.close()

    def receive(self, frames: Sequence[bytes], count: int | None = None) -> None:
        """Apply one ``[topic, seq, payload]`` message at once (a refused one is counted)."""
        run_steps(self.receive_steps(frames, count))

    def receive_steps(
        self, frames: Sequence[bytes], count: int | None = None
    ) -> Generator[None, None, None]:
        """:meth:`receive`, yielding between events: the whole message is decoded and
        checked against every cap before the first event is applied."""
        if count == 0:
            return  # nothing was read
        try:
            seq = check_frames(frames, count)
            batch = yield from decode_steps(frames[2])
        except EventFormatError as exc:
            self.refuse(exc)
            return
        except Exception as exc:  # a decoder bug: the message is refused, the stream goes on
            self.refuse(EventFormatError(f"{type(exc).__name__}: {exc}", "error"))
            return
        overflows = self.cache.overflows
        cleared, gap = yield from self.cache.receive_steps(seq, batch)
        self.accepted += 1
        self.metrics.batches.labels(self.instance).inc()
        if self.cache.overflows != overflows:
            self._count_refusal("resident", f"over {MAX_RESIDENT_BLOCKS} resident blocks")
        if gap:
            self.metrics.gaps.labels(self.instance).inc()
            self._gaps += 1
            if self._gaps & (self._gaps - 1) == 0:  # 1st, 2nd, 4th...: logs stay bounded
                log.warning(
                    "kv events %s: sequence gap at %d (%d so far); cache size unknown until "
                    "it is cleared",
                    self.instance,
                    seq,
                    self._gaps,
                )
        if cleared:
            self._forget_due = True
            if time.monotonic() - self._scanned_at >= INDEX_SCAN_INTERVAL_S:
                self.maintain(time.monotonic())
        self.metrics.engine_tokens.labels(self.instance).set(
            self.cache.tokens if self.cache.known else -1
        )

    def refuse(self, exc: EventFormatError) -> None:
        """Count a refused message; the engine's set is unknown from here (a message of its
        stream was not applied) until it is cleared or restarts."""
        self.cache.known = False
        self.metrics.engine_tokens.labels(self.instance).set(-1)
        self._count_refusal(exc.reason, str(exc))

    def _count_refusal(self, reason: str, detail: str) -> None:
        self.metrics.refused.labels(self.instance, reason).inc()
        n = self._refusals[reason] = self._refusals.get(reason, 0) + 1
        if n & (n - 1) == 0:  # the 1st, 2nd, 4th, 8th... of a reason: logs stay bounded
            log.warning(
                "kv events %s: message refused (%s, %d so far): %.200s",
                self.instance,
                reason,
                n,
                detail,
            )

    def maintain(self, now: float) -> None:
        """The index work the events call for, at most once per :data:`INDEX_SCAN_INTERVAL_S`
        (each scans the prefix index): forget the instance's entries after a clear, then
        :meth:`fit`. A publisher clearing or restarting in a loop costs no more."""
        if now - self._scanned_at < INDEX_SCAN_INTERVAL_S:
            return
        self._scanned_at = now
        if self._forget_due:
            self._forget_due = False
            self.index.forget_instance(self.instance)
        self.fit(now)

    def fit(self, now: float) -> int:
        """Drop the index's oldest entries for the instance beyond what the engine holds."""
        if not self.cache.known:
            return 0
        n = blocks_to_evict(self.index.held(self.instance), self.block_tokens, self.cache.tokens)
        dropped = self.index.shrink_instance(self.instance, n, before=now - SETTLE_S) if n else 0
        if dropped:
            self.metrics.evicted.labels(self.instance).inc(dropped)
        return dropped


def endpoint_key(endpoint: str) -> str:
    """An endpoint as compared for sharing: case-folded, an IPv4-mapped IPv6 host as IPv4."""
    key = endpoint.strip().lower()
    mapped = "tcp://[::ffff:"
    if key.startswith(mapped) and "]:" in key:
        host, _, port = key[len(mapped) :].partition("]:")
        if "." in host:
            return f"tcp://{host}:{port}"
    return key


def followed_endpoints(instances: Iterable[Instance]) -> dict[str, str]:
    """Instance id → endpoint to follow. An endpoint the table names for several instances is
    followed for none of them: its events could not be attributed to one (logged)."""
    wanted = {i.id: i.kv_events_endpoint for i in instances if i.kv_events_endpoint}
    owners: dict[str, list[str]] = {}
    for inst, endpoint in wanted.items():
        owners.setdefault(endpoint_key(endpoint), []).append(inst)
    shared = [ids for ids in owners.values() if len(ids) > 1]
    for ids in shared:
        log.warning("kv events: instances %s share an endpoint; none is followed", sorted(ids))
    refused = {inst for ids in shared for inst in ids}
    return {inst: endpoint for inst, endpoint in wanted.items() if inst not in refused}


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
        listed = [i for i in instances if i.kv_events_endpoint]
        wanted = followed_endpoints(listed)
        self.metrics.shared_endpoints.set(len(listed) - len(wanted))
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
