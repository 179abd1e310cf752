"""The I/O of peer sync (``peer_load.py``): publish this edge's reports and fold in the
other edges' over the region's Redis, pub/sub channel ``fedinfer:edge-load:<db>:<region>``.
Reconnects with backoff while Redis is away; meanwhile the peers expire and every edge routes
on its own view and the scrapes.

Anyone who reaches that Redis can publish on the channel: each report is sealed with the
region's peer key (``peer_auth.py``) and a message is applied only once its header, age, MAC
and sequence number hold, before its JSON is decoded; every refusal is counted in
``fedinfer_edge_peer_messages{result=...}``, and the receiving loop yields to the edge's
other work every :data:`YIELD_EVERY` messages, so a flood on the channel cannot hold the
event loop."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import re
import secrets
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import redis
import redis.asyncio as aioredis
from prometheus_client import CollectorRegistry, Counter, Gauge
from redis.connection import parse_url

from regions.edge.policy.admission import Admission
from regions.edge.policy.peer_auth import PEER_ID, SEAL_BYTES, open_sealed, peer_of, seal
from regions.edge.policy.prefix_index import PrefixIndex
from regions.edge.policy.sessions import SessionMap
from regions.edge.view.load import LoadBoard
from regions.edge.view.peer_load import (
    HEARTBEAT_S,
    MAX_CHAIN_BLOCKS,
    MAX_CHAINS,
    MAX_MESSAGE_BYTES,
    MAX_READING_COUNT,
    MAX_READINGS,
    MAX_REPORT_BLOCKS,
    MAX_SESSIONS,
    Chain,
    Counts,
    DemandMeter,
    PeerLoads,
    Placed,
    Reading,
    Report,
    board_counts,
    busiest,
    decode,
    demand_shares,
    encode,
    step_shares,
)
from regions.engines.metrics import EngineLoad
from regions.tables.schema import Instance

log = logging.getLogger("fedinfer.edge.peers")

#: At most one message per this many seconds (a burst of requests is one message).
MIN_INTERVAL_S = 0.005
#: Reconnect backoff while Redis is away.
RETRY_S = (0.2, 5.0)
#: Messages received in a row before the subscriber lets the event loop run other work.
YIELD_EVERY = 16
#: What becomes of a message received (``fedinfer_edge_peer_messages{result}``): applied;
#: applied with counts clamped to the instance's bounds; or refused, and why.
RESULTS = (
    "applied",
    "clamped",
    "unsigned",
    "malformed",
    "unknown_key",
    "stale",
    "bad_signature",
    "replayed",
    "too_many_peers",
)


def wall_ms() -> int:
    return time.time_ns() // 1_000_000


def channel(region: str, redis_url: str) -> str:
    """The region's load channel on the Redis database of ``redis_url``.

    Pub/sub channels belong to the server, not to a database: two deployments (or test
    workers) sharing one Redis on different databases would hear each other's reports, so the
    database's number is part of the name.
    """
    database = parse_url(redis_url).get("db", 0)  # type: ignore[no-untyped-call]  # redis-py
    return f"fedinfer:edge-load:{database}:{region}"


class PeerSync:
    """Publishes this edge's counts (soon after each change, and every :data:`HEARTBEAT_S`)
    and folds in the peers' over Redis pub/sub; reconnects while Redis is away."""

    def __init__(
        self,
        url: str,
        region: str,
        peers: PeerLoads,
        registry: CollectorRegistry,
        admission: Admission | None = None,
        *,
        keys: Mapping[str, bytes],
        clock_ms: Callable[[], int] = wall_ms,
        placed: PeerPlacements | None = None,
    ) -> None:
        if not keys:
            raise ValueError("peer sync needs the region's peer keys to sign its reports")
        #: The region's peer keys (``peer_auth.peer_keys``): the first signs, all verify.
        self.keys = keys
        self.clock_ms = clock_ms
        #: This edge's messages so far (each one's sequence number).
        self.seq = 0
        self._me = peers.me.encode()
        self.url = url
        self.channel = channel(region, url)
        self.peers = peers
        self.board = peers.board
        #: Whose rate-limit shares follow the tenants' demand (None: 1/n each).
        self.admission = admission
        self.meter = DemandMeter()
        #: This edge's demand per tenant as last published (what its peers hold of it).
        self._demand: dict[str, float] = {}
        self._shared_at = -math.inf
        #: The counts as last published (a report of changes leaves out the rest).
        self._published: dict[str, Counts] = {}
        #: Prompts placed on the byte estimate since the last report (``sent``), and where the
        #: peers' go (the edge's prefix index, ``build_peer_sync``).
        self._chains: list[Chain] = []
        self._blocks = 0
        #: Where the peers' prompts and sessions go (None: nowhere).
        self.placed = placed
        #: Sessions placed on a new instance since the last report (``session_placed``), and
        #: where the peers' go (the edge's session map, ``build_peer_sync``).
        self._sessions: list[Placed] = []
        #: The engines this edge scraped since the last report (``scraped``).
        self._readings: dict[str, Reading] = {}
        self._changed = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self.counted = Gauge(
            "fedinfer_edge_peers",
            "Other edges of the region whose in-flight requests this edge counts (peer sync)",
            registry=registry,
        )
        self.up = Gauge(
            "fedinfer_edge_peer_sync_up",
            "1 while this edge is subscribed to its region's load channel",
            registry=registry,
        )
        self.messages = Counter(
            "fedinfer_edge_peer_messages",
            "Messages received on the region's load channel, by outcome: applied, clamped "
            "(applied, counts past an instance's bounds cut), or refused (unsigned, malformed, "
            "unknown_key, stale, bad_signature, replayed, too_many_peers)",
            ["result"],
            registry=registry,
        )
        for result in RESULTS:
            self.messages.labels(result)
        self.oversized = Counter(
            "fedinfer_edge_peer_reports_oversized",
            "Reports not sent because they exceeded the size peers accept",
            registry=registry,
        )
        self.readings = Counter(
            "fedinfer_edge_engine_readings",
            "Engine load readings (/metrics) this edge used, by origin: its own scrape, or "
            "a peer's in its place",
            ["origin"],
            registry=registry,
        )
        self.sessions_dropped = Counter(
            "fedinfer_edge_peer_sessions_unshared",
            "Sessions placed past a report's limit, which the other edges did not hear of",
            registry=registry,
        )
        self.chains_dropped = Counter(
            "fedinfer_edge_peer_prompts_unshared",
            "Prompts sent past a report's limit, whose prefix the other edges did not hear of",
            registry=registry,
        )

    def sent(self, instance: str, hashes: Sequence[int]) -> None:
        """A prompt went to ``instance``: tell the peers with the next report."""
        head = list(hashes[:MAX_CHAIN_BLOCKS])
        if len(self._chains) >= MAX_CHAINS or self._blocks + len(head) > MAX_REPORT_BLOCKS:
            self.chains_dropped.inc()
            return
        self._chains.append((instance, head))
        self._blocks += len(head)
        self._changed.set()

    def session_placed(self, key: int, instance: str) -> None:
        """A session went to ``instance`` (new here, or moved): tell the peers with the next
        report, so that its next turn stays there whichever edge it reaches."""
        if len(self._sessions) >= MAX_SESSIONS:
            self.sessions_dropped.inc()
            return
        self._sessions.append((key, instance))
        self._changed.set()

    def scraped(self, instance: str, engine: EngineLoad) -> None:
        """This edge read ``instance``'s load: share it with the next report."""
        self.readings.labels("scraped").inc()
        readings = self._readings
        if len(readings) < MAX_READINGS or instance in readings:
            # Within what peers accept, whatever the engine claims (a report they refuse
            # would lose its load counts too).
            readings[instance] = (
                min(max(engine.num_requests_running, 0), MAX_READING_COUNT),
                min(max(engine.num_requests_waiting, 0), MAX_READING_COUNT),
                min(1.0, max(0.0, engine.kv_cache_usage_perc)),
            )
            self._changed.set()

    def start(self) -> None:
        self.board.on_change = self._changed.set
        self.board.on_scraped = self.scraped
        self._tasks = [
            asyncio.create_task(self._publish_loop()),
            asyncio.create_task(self._subscribe_loop()),
        ]

    async def stop(self) -> None:
        self.board.on_change = None
        self.board.on_scraped = None
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []

    def _client(self) -> aioredis.Redis:
        return aioredis.Redis.from_url(
            self.url, socket_connect_timeout=2.0, socket_timeout=2.0, health_check_interval=0
        )

    async def _publish_loop(self) -> None:
        backoff = RETRY_S[0]
        client = self._client()
        try:
            while True:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(HEARTBEAT_S):
                        await self._changed.wait()
                self._changed.clear()
                now = time.monotonic()
                heard = len(self.peers.peers)
                self.counted.set(self.peers.expire(now))
                if len(self.peers.peers) != heard:
                    self._share(now)  # an edge went silent: 1/n each
                counts = board_counts(self.board)
                chains, self._chains, self._blocks = self._chains, [], 0
                sessions, self._sessions = self._sessions, []
                readings, self._readings = self._readings, {}
                demand = None
                if now - self._shared_at >= HEARTBEAT_S:
                    self._shared_at = now
                    demand = self._measure(now)
                    message = encode(self.peers.me, counts, demand, chains, sessions, readings)
                else:
                    last = self._published
                    changes = {i: c for i, c in counts.items() if last.get(i) != c}
                    message = encode(self.peers.me, changes, None, chains, sessions, readings)
                if len(message) > MAX_MESSAGE_BYTES:
                    # Its peers would refuse it: they go on without hearing from this edge
                    # (after EXPIRE_S, as if it were silent: 1/n shares, its load in scrapes).
                    self.oversized.inc()
                    self.chains_dropped.inc(len(chains))
                    self.sessions_dropped.inc(len(sessions))
                    log.error(
                        "peer sync: a %d-byte report exceeds the limit; not sent", len(message)
                    )
                    continue
                self.seq += 1
                sealed = seal(self.keys, self.peers.me, self.seq, self.clock_ms(), message)
                try:
                    await client.publish(self.channel, sealed)
                    self._published = counts
                    if demand is not None:
                        self._demand = demand
                        self._share(now)
                    backoff = RETRY_S[0]
                except (OSError, redis.RedisError) as exc:
                    log.warning("peer sync: publishing to %s failed: %s", self.channel, exc)
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, RETRY_S[1])
                    continue
                await asyncio.sleep(MIN_INTERVAL_S)  # changes meanwhile go in the next one
        finally:
            await client.aclose()

    def _measure(self, now: float) -> dict[str, float]:
        """This edge's demand per limited tenant now (for its next full report)."""
        admission = self.admission
        if admission is None or not admission.enabled:
            return {}
        return busiest(self.meter.update(admission.limited(), now))

    def _share(self, now: float) -> None:
        """Give each tenant's limits to the edges in proportion to their published demand,
        while every edge of the table is heard (else 1/n each).

        Run when this edge has published its demand and when a peer's full report arrives,
        always from the demands as published: every edge then computes from the same figures
        (shares summing to 1) but for the few ms a report takes to arrive. Each run moves the
        shares a step towards their targets (``step_shares``); with an edge unheard they are
        1/n at once."""
        admission = self.admission
        if admission is None or not admission.enabled:
            return
        peers = self.peers.peers
        edges = len(peers) + 1
        if admission.local_edges <= 1 or edges != admission.local_edges:
            admission.reshare({}, now)
            return
        target = demand_shares(self._demand, (p.demand for p in peers.values()), edges)
        admission.reshare(step_shares(admission.shares, target, 1.0 / edges), now)

    async def _subscribe_loop(self) -> None:
        backoff = RETRY_S[0]
        while True:
            client = self._client()
            # Typed Any: the installed redis stubs predate the async client's aclose().
            pubsub: Any = client.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(self.channel)
                self.up.set(1)
                backoff = RETRY_S[0]
                received = 0
                while True:
                    # Blocks until a message (peers publish every HEARTBEAT_S at least); a
                    # message already buffered returns at once, hence the yield below.
                    message = await pubsub.get_message(timeout=None)
                    if message is not None and message.get("type") == "message":
                        self._receive(message["data"])
                        received += 1
                        if received % YIELD_EVERY == 0:
                            await asyncio.sleep(0)
            except (OSError, redis.RedisError) as exc:
                log.warning("peer sync: subscription to %s lost: %s", self.channel, exc)
            finally:
                self.up.set(0)
                with contextlib.suppress(OSError, redis.RedisError):
                    await pubsub.aclose()
                    await client.aclose()
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, RETRY_S[1])

    def _receive(self, data: object) -> None:
        """One message off the channel: applied if it holds, else refused and counted."""
        now = time.monotonic()
        parsed = self._open(data, now)
        if parsed is not None:
            self._apply(parsed, now)

    def _open(self, data: object, now: float) -> Report | None:
        """A message's report if it is another edge's, signed, fresh, not seen before and
        well-formed (``peer_auth.open_sealed``, ``PeerLoads.accept``, ``decode``); else
        None, the refusal counted (this edge's own messages are skipped uncounted)."""
        if not isinstance(data, bytes) or len(data) > MAX_MESSAGE_BYTES + SEAL_BYTES:
            self.messages.labels("malformed").inc()
            return None
        if peer_of(data) == self._me:
            return None  # this edge's own, back from the channel
        opened = open_sealed(data, self.keys, self.clock_ms())
        if isinstance(opened, str):
            self.messages.labels(opened).inc()
            return None
        refused = self.peers.accept(opened.peer, opened.seq, now)
        if refused is not None:
            self.messages.labels(refused).inc()
            return None
        parsed = decode(opened.body)
        if parsed is None or parsed.peer != opened.peer:
            self.messages.labels("malformed").inc()
            return None
        return parsed

    def _apply(self, parsed: Report, now: float) -> None:
        heard = len(self.peers.peers)
        if parsed.readings:
            # First: the counts that follow were sent after (most of) these readings.
            self.readings.labels("peer").inc(self.peers.read(parsed.readings, now))
        clamped = self.peers.apply(parsed.peer, parsed.counts, now, parsed.demand)
        self.messages.labels("clamped" if clamped else "applied").inc()
        if parsed.demand is not None or len(self.peers.peers) != heard:
            self._share(now)
        placed = self.placed
        if placed is not None:
            in_table = self.peers.capacity_of
            for instance, hashes in parsed.chains:
                if in_table(instance) is not None:
                    placed.chain(instance, hashes)
            for key, instance in parsed.sessions:
                if in_table(instance) is not None:
                    placed.session(key, instance)


def peer_id(name: str | None) -> str:
    """This edge process's id on the channel: its name (if any), host, pid and a nonce (a
    restarted container may have the same host name and pid), within what peers accept
    (``peer_auth.PEER_ID``)."""
    host = re.sub(r"[^A-Za-z0-9.-]", "-", os.uname().nodename)[:32]
    own = f"{name or 'edge'}@{host}:{os.getpid()}:{secrets.token_hex(3)}"
    if not PEER_ID.fullmatch(own.encode()):
        raise ValueError(f"edge name {name!r} cannot name this edge on the peer channel")
    return own


class PeerPlacements(Protocol):
    """Where the other edges' placements go (instances of the table only)."""

    def chain(self, instance: str, hashes: Sequence[int]) -> None:
        """Another edge sent a prompt of these block hashes to ``instance``."""

    def session(self, key: int, instance: str) -> None:
        """Another edge placed session ``key`` on ``instance``."""


class Waker(Protocol):
    def wake(self, inst: Instance, slots: int) -> None: ...


class PeerEdge(Protocol):
    """What peer sync reads and feeds of its edge (the edge's table state is replaced whole
    on a new table, so it is read through the edge at each use)."""

    @property
    def instances(self) -> dict[str, Instance]: ...
    @property
    def prefill_rates(self) -> dict[str, float]: ...
    @property
    def prefix(self) -> PrefixIndex: ...
    @property
    def sessions(self) -> SessionMap: ...
    @property
    def lines(self) -> Waker: ...


class _EdgePlacements:
    """The peers' prompts go to the prefix index (the instance will hold their blocks), their
    sessions to the session map (their next turns stay there)."""

    __slots__ = ("edge",)

    def __init__(self, edge: PeerEdge) -> None:
        self.edge = edge

    def chain(self, instance: str, hashes: Sequence[int]) -> None:
        self.edge.prefix.insert(hashes, instance, time.monotonic())

    def session(self, key: int, instance: str) -> None:
        self.edge.sessions.remember(key, instance)


def build_peer_sync(
    url: str | None,
    region: str,
    holder: str | None,
    keys: Mapping[str, bytes],
    loads: LoadBoard,
    admission: Admission,
    registry: CollectorRegistry,
    edge: PeerEdge,
) -> PeerSync | None:
    """The edge's peer sync over ``url`` as ``holder`` of ``region``: it feeds the load board
    and admission's rate shares, and reads and feeds what :class:`PeerEdge` names. None
    without a Redis to share over (``--peer-redis-url``)."""
    if not url:
        return None

    def rate_of(name: str) -> float:
        return edge.prefill_rates.get(name, 0.0) * loads.get(name).speed

    def freed(name: str, slots: int) -> None:
        inst = edge.instances.get(name)
        if inst is not None:
            edge.lines.wake(inst, slots)

    def capacity(name: str) -> int | None:
        inst = edge.instances.get(name)
        return None if inst is None else inst.max_concurrency

    return PeerSync(
        url,
        region,
        PeerLoads(loads, peer_id(holder), rate_of, freed, capacity),
        registry,
        admission,
        keys=keys,
        placed=_EdgePlacements(edge),
    )
