"""Live load per instance: the edge's own in-flight counts (exact, updated instantly) merged
with each engine's ``/metrics`` (every edge's traffic, but up to a scrape interval old).

``outstanding`` = the engine's running + waiting at the last scrape, plus the requests sent
since that scrape and minus those finished, never below the requests known in flight. An old
scrape (engine too busy to answer) keeps the engine's last known load.
``pending_tokens``: the uncached prompt tokens sent, drained at the engine's prefill rate — the
prefill work the engine probably still has ahead of a new request.

"Sent" is this edge's own requests, and with peer sync (``peer_load.py``) the other edges' of
the region too, as they publish them: the same counters take both.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import time
from collections.abc import Callable, Hashable, Iterator, Mapping
from dataclasses import dataclass, field

import httpx
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from regions.edge.policy.speed import (
    GAIN,
    Histogram,
    answer_scale,
    deviation_in_use,
    full_batch_step,
    known,
    learned,
    smoothed,
    step_interval,
    typical,
)
from regions.engines.metrics import EngineLoad, parse_vllm_metrics

log = logging.getLogger("fedinfer.edge.load")

#: How far one scrape interval may differ from the configured one (a fraction of it).
SCRAPE_JITTER = 0.05


class InstanceLoad:
    """Mutable load record of one instance (one per instance, reused across requests)."""

    __slots__ = (
        "admitted_since_scrape",
        "cap",
        "deviation",
        "ended_total",
        "engine",
        "finished_since_scrape",
        "full_step_s",
        "inflight",
        "itl_seen",
        "learned_speed",
        "mean_service_s",
        "mean_uncached_tokens",
        "peer_inflight",
        "pending_at",
        "pending_tokens",
        "scraped_at",
        "seen_running",
        "sent_total",
        "shared_at",
        "speed",
        "taught",
        "tokens",
        "uncached_total",
    )

    def __init__(self) -> None:
        #: This edge's requests in flight here (exact), and the other edges' as they published.
        self.inflight = 0
        self.peer_inflight = 0
        #: This edge's running totals, published to its peers (``peer_load.py``): requests
        #: sent and ended, uncached prompt tokens sent.
        self.sent_total = 0
        self.ended_total = 0
        self.uncached_total = 0
        self.engine: EngineLoad | None = None
        self.scraped_at = 0.0
        #: When a peer's reading of the engine last arrived (peer sync): while it is fresh,
        #: this edge does not scrape the engine itself (``scrape_loop``).
        self.shared_at = -math.inf
        self.admitted_since_scrape = 0
        self.finished_since_scrape = 0
        #: EWMA of end-to-end seconds per request on this instance (slot turnover).
        self.mean_service_s = 2.0
        #: EWMA of uncached prompt tokens per request routed here (queued prefill work).
        self.mean_uncached_tokens = 256.0
        #: Prompt tokens (edge estimate) sent to this instance since start (heartbeat rate).
        self.tokens = 0
        #: Uncached prompt tokens sent here and probably not computed yet, as of ``pending_at``.
        self.pending_tokens = 0.0
        self.pending_at = 0.0
        #: The engine's prefill rate over the table's figure, as learned from its answers
        #: (``taught`` of them) and as the scheduler uses it: its kind's scale times its own
        #: deviation from it, which moves only out of a band (``speed.py``).
        self.learned_speed = 1.0
        self.taught = 0
        self.deviation = 1.0
        self.speed = 1.0
        #: The table's cap on its requests (0: unknown, no step is measured).
        self.cap = 0
        #: What a full batch of the engine steps, in seconds, as its own inter-token latency
        #: histogram says (``speed.py``; 0: not measured yet); the reading of that histogram,
        #: and the requests then running, the next interval starts from.
        self.full_step_s = 0.0
        self.itl_seen: Histogram = (0.0, 0)
        self.seen_running = 0

    def pending(self, now: float, prefill_tokens_per_s: float) -> float:
        """Prefill tokens still ahead on the engine: what this edge sent, drained at the
        engine's prefill rate since the last look (the engine works through them in order)."""
        if self.pending_tokens > 0.0:
            drained = (now - self.pending_at) * prefill_tokens_per_s
            self.pending_tokens = max(0.0, self.pending_tokens - drained)
        self.pending_at = now
        return self.pending_tokens

    def admit(self, uncached_tokens: int) -> None:
        """Count a request sent; call right after :meth:`pending` (same instant, no await)."""
        self.inflight += 1
        self.admitted_since_scrape += 1
        self.sent_total += 1
        self.uncached_total += uncached_tokens
        self.mean_uncached_tokens += 0.1 * (uncached_tokens - self.mean_uncached_tokens)
        self.pending_tokens += uncached_tokens

    def finish(self, duration_s: float) -> None:
        self.inflight -= 1
        self.finished_since_scrape += 1
        self.ended_total += 1
        self.mean_service_s += 0.1 * (duration_s - self.mean_service_s)
        if self.inflight + self.peer_inflight <= 0:
            self.pending_tokens = 0.0  # everything sent has finished, so it was prefilled

    def release(self) -> None:
        """Undo an admission that never reached the engine (connect failure)."""
        self.inflight -= 1
        self.admitted_since_scrape -= 1
        self.ended_total += 1  # peers' totals only grow (a drop means a restarted edge)

    def peers_sent(self, sent: int, ended: int, uncached: int, now: float, rate: float) -> None:
        """Count what another edge sent here and saw end since its last report."""
        self.admitted_since_scrape += sent
        self.finished_since_scrape += ended
        if uncached:
            self.pending(now, rate)  # drain up to now first: these tokens were just queued
            self.pending_tokens += uncached
        if self.inflight + self.peer_inflight <= 0:
            self.pending_tokens = 0.0

    def scraped(self, engine: EngineLoad, now: float, slowdown: float = 1.0) -> bool:
        """Take a reading of the engine; whether it measured the engine's step anew."""
        self.engine = engine
        self.scraped_at = now
        self.admitted_since_scrape = 0
        self.finished_since_scrape = 0
        count = engine.inter_token_latency_seconds_count
        if not count or not self.cap:  # a peer's shared reading carries no histogram
            return False
        running = engine.num_requests_running
        now_seen = (engine.inter_token_latency_seconds_sum, count)
        if not self.itl_seen[1]:  # the first reading: where the first interval starts
            self.itl_seen, self.seen_running = now_seen, running
            return False
        self.itl_seen, mean = step_interval(self.itl_seen, now_seen)
        if mean is None:
            if self.itl_seen[1] == count:  # restarted: the interval starts here
                self.seen_running = running
            return False
        fill = (self.seen_running + running) / 2 / self.cap
        self.seen_running = running
        self.full_step_s = smoothed(self.full_step_s, full_batch_step(mean, fill, slowdown))
        return True

    def shared(self, engine: EngineLoad, now: float) -> None:
        """A reading another edge of the region scraped and shared, in place of this edge's."""
        self.scraped(engine, now)
        self.shared_at = now

    def snapshot(self) -> tuple[int, int, float]:
        """(outstanding requests, of which waiting to be scheduled, KV-cache usage 0..1).

        However old the last scrape (an engine too busy to answer ``/metrics`` in time is the
        usual cause), its load stands rather than silence being read as idle; only what this
        edge itself sent or saw finish since is added or taken off (a dead engine is ejected
        by health checks, not by this number)."""
        engine = self.engine
        known = self.inflight + self.peer_inflight
        if engine is None:
            return known, 0, 0.0
        delta = self.admitted_since_scrape - self.finished_since_scrape
        total = engine.num_requests_running + engine.num_requests_waiting + delta
        # Requests sent since the scrape are not counted as waiting here: their prefill work is
        # in ``pending_tokens`` with its real size (an engine with free seats runs them at once).
        return max(known, total), engine.num_requests_waiting, engine.kv_cache_usage_perc


@dataclass
class KindSpeed:
    """What the instances of one kind learned together: their common scale (``speed.py``).
    Each member's deviation from it is moved at the member's own answers."""

    scale: float = 1.0
    taught: int = 0
    members: list[InstanceLoad] = field(default_factory=list)
    #: The members' median learned scale, taken again every ``len(members)`` answers.
    usual: float = 1.0
    answers: int = 0
    #: What a full batch steps, the median of the members measured (0: none yet).
    full_step_s: float = 0.0

    def take_step(self) -> None:
        """The median of the members' measured full-batch steps (``speed.py``)."""
        steps = [m.full_step_s for m in self.members if m.full_step_s > 0.0]
        self.full_step_s = typical(steps) if steps else 0.0

    def take_usual(self) -> None:
        """The median of the members that have learned enough (``speed.known``)."""
        self.answers = 0
        self.usual = typical([m.learned_speed for m in self.members if known(m.taught)])


class LoadBoard:
    """instance id → :class:`InstanceLoad`, kept in step with the table.

    ``scrape_timeout_s`` is the scrapes' own timeout, separate from the health probe's: a busy
    engine answers ``/metrics`` late, and a reading that arrives late is still the one that
    says it is busy, whereas a slow ``/health`` should count towards ejection.
    """

    def __init__(self, scrape_timeout_s: float = 2.0, decode_slowdown: float = 1.0) -> None:
        self.loads: dict[str, InstanceLoad] = {}
        #: The step's prior shape (``SchedulerConfig.decode_slowdown``), to keep measured
        #: steps in full-batch terms.
        self.decode_slowdown = decode_slowdown
        self.kinds: dict[Hashable, KindSpeed] = {}
        self.kind_of: dict[str, KindSpeed] = {}
        self.scrape_timeout_s = scrape_timeout_s
        #: Called when this edge sends or ends a request (peer sync publishes soon after).
        self.on_change: Callable[[], None] | None = None
        #: Called with each reading this edge scraped (peer sync shares it).
        self.on_scraped: Callable[[str, EngineLoad], None] | None = None

    def sync(self, kinds: Mapping[str, Hashable], caps: Mapping[str, int] | None = None) -> None:
        """Keep the loads of the table's instances (id -> its kind: the instances whose speed
        is learned together, ``speed.py``; ``caps``: id -> the table's ``max_concurrency``,
        without which an instance's step is not measured)."""
        self.loads = {i: self.loads.get(i) or InstanceLoad() for i in kinds}
        for instance, load in self.loads.items():
            load.cap = (caps or {}).get(instance, 0)
        old = self.kinds
        self.kinds = {}
        self.kind_of = {}
        for instance, key in kinds.items():
            kind = self.kinds.get(key)
            if kind is None:
                kind = self.kinds[key] = (
                    KindSpeed(old[key].scale, old[key].taught) if key in old else KindSpeed()
                )
            kind.members.append(self.loads[instance])
            self.kind_of[instance] = kind
        for kind in self.kinds.values():
            kind.take_usual()
            kind.take_step()
            for load in kind.members:
                load.speed = kind.scale * load.deviation

    def scraped(self, instance: str, engine: EngineLoad, now: float) -> None:
        """This edge's own reading of ``instance``'s engine."""
        load = self.loads.get(instance)
        if load is not None and load.scraped(engine, now, self.decode_slowdown):
            self.kind_of[instance].take_step()

    def full_step(self, instance: str) -> float:
        """What a full batch of ``instance``'s kind steps, as measured (0: not yet)."""
        kind = self.kind_of.get(instance)
        return kind.full_step_s if kind is not None else 0.0

    def learn(self, instance: str, predicted_s: float, observed_s: float) -> None:
        """One answer of ``instance``, predicted at ``predicted_s`` (the rate-bound part of its
        expected TTFT), came after ``observed_s``: learn from it the instance's speed and its
        kind's, and set the speeds the scheduler uses (``speed.py``)."""
        load = self.loads.get(instance)
        said = answer_scale(load.speed, predicted_s, observed_s) if load else None
        if load is None or said is None:
            return
        load.learned_speed, load.taught = learned(load.learned_speed, said, load.taught)
        kind = self.kind_of[instance]
        members = kind.members
        per_instance = GAIN / len(members)
        kind.scale, kind.taught = learned(
            kind.scale, said / load.deviation, kind.taught, per_instance
        )
        if len(members) > 1 and known(load.taught):
            kind.answers += 1
            # The median again once a round of answers, and as a member joins it.
            if kind.answers >= len(members) or not known(load.taught - 1):
                kind.take_usual()
            load.deviation = deviation_in_use(load.deviation, load.learned_speed / kind.usual)
        scale = kind.scale
        for member in members:
            member.speed = scale * member.deviation

    def get(self, instance: str) -> InstanceLoad:
        load = self.loads.get(instance)
        if load is None:
            # Instance removed from the table while a request was in flight: keep counting.
            load = InstanceLoad()
        return load


class SpeedCollector(Collector):
    """Each instance's prefill rate as the scheduler uses it (the table's figure times what
    its kind learned and its deviation in use, ``speed.py``), beside the table's own figure
    and what the instance's own answers say."""

    def __init__(self, board: LoadBoard, table_rates: Callable[[], Mapping[str, float]]) -> None:
        self.board = board
        self.table_rates = table_rates

    def collect(self) -> Iterator[GaugeMetricFamily]:
        learned = GaugeMetricFamily(
            "fedinfer_edge_prefill_tokens_per_s",
            "Prefill tokens/s per instance: the table's figure (source=table), the one the "
            "scheduler uses, learned from the answers of the instance's kind (source=learned), "
            "and what the instance's own answers say (source=observed)",
            labels=["instance", "source"],
        )
        for instance, rate in sorted(self.table_rates().items()):
            load = self.board.loads.get(instance)
            learned.add_metric([instance, "table"], rate)
            learned.add_metric([instance, "learned"], rate * (load.speed if load else 1.0))
            observed = load.learned_speed if load else 1.0
            learned.add_metric([instance, "observed"], rate * observed)
        yield learned
        step = GaugeMetricFamily(
            "fedinfer_edge_full_batch_step_seconds",
            "What a full batch of each instance steps, as its engine's inter-token latency "
            "histogram says between the edge's readings (source=observed), and its kind's "
            "median the scheduler uses (source=used); absent: not measured yet",
            labels=["instance", "source"],
        )
        for instance, load in sorted(self.board.loads.items()):
            if load.full_step_s > 0.0:
                step.add_metric([instance, "observed"], load.full_step_s)
                step.add_metric([instance, "used"], self.board.full_step(instance))
        yield step


async def scrape_once(
    client: httpx.AsyncClient,
    board: LoadBoard,
    instance: str,
    url: str,
    on_error: Callable[[str], None] | None = None,
) -> None:
    try:
        async with asyncio.timeout(board.scrape_timeout_s):
            text = await _metrics_text(client, url, board.scrape_timeout_s)
        engine = parse_vllm_metrics(text)
    except (httpx.HTTPError, ValueError, TimeoutError) as exc:
        # Health decides ejection; a failed scrape only lets the numbers go stale (and is
        # counted, so a parser that stopped understanding an engine shows on a dashboard).
        log.debug("scrape of %s failed: %s", instance, exc)
        if on_error is not None:
            on_error(instance)
        return
    if instance in board.loads:
        board.scraped(instance, engine, time.monotonic())
        shared = board.on_scraped
        if shared is not None:
            shared(instance, engine)


#: An engine's ``/metrics`` longer than this is refused unread past it (vLLM's is tens of KiB,
#: a few hundred with many adapters): a broken or hostile engine cannot make the edge buffer
#: and parse megabytes on its event loop every scrape.
MAX_METRICS_BYTES = 4 * 1024 * 1024


async def _metrics_text(client: httpx.AsyncClient, url: str, timeout_s: float) -> str:
    """The body of ``url/metrics``, at most :data:`MAX_METRICS_BYTES` (else ValueError); the
    whole scrape, a body trickled byte by byte included, within the caller's deadline."""
    async with client.stream("GET", url + "/metrics", timeout=timeout_s) as resp:
        resp.raise_for_status()
        chunks: list[bytes] = []
        size = 0
        async for chunk in resp.aiter_bytes():
            size += len(chunk)
            if size > MAX_METRICS_BYTES:
                raise ValueError(f"/metrics longer than {MAX_METRICS_BYTES} bytes")
            chunks.append(chunk)
    return b"".join(chunks).decode("utf-8", "replace")


async def scrape_loop(
    client: httpx.AsyncClient,
    board: LoadBoard,
    targets: Callable[[], list[tuple[str, str]]],
    interval_s: float,
    on_error: Callable[[str], None] | None = None,
) -> None:
    """Scrape every instance's ``/metrics`` every ``interval_s`` until cancelled.

    Each instance on its own: a starved engine answering late (up to the scrape timeout)
    delays its own next reading, never the other engines'. An instance a peer read less than
    ``interval_s`` ago (peer sync shares readings) is not scraped again: however many edges a
    region runs, each engine answers about ``1 / interval_s`` scrapes a second, not that many
    per edge. The interval varies by ±:data:`SCRAPE_JITTER` so that edges which started in
    step drift apart, and the first to scrape stands in for the others."""
    running: dict[str, asyncio.Task[None]] = {}
    loads = board.loads
    try:
        while True:
            started = time.monotonic()
            pairs = targets()
            for instance, url in pairs:
                task = running.get(instance)
                load = loads.get(instance)
                if load is not None and started - load.shared_at < interval_s:
                    continue
                if task is None or task.done():
                    running[instance] = asyncio.create_task(
                        scrape_once(client, board, instance, url, on_error)
                    )
            live = {instance for instance, _ in pairs}
            for instance in [i for i in running if i not in live and running[i].done()]:
                del running[instance]
            period = interval_s * random.uniform(1.0 - SCRAPE_JITTER, 1.0 + SCRAPE_JITTER)
            await asyncio.sleep(max(0.0, period - (time.monotonic() - started)))
    finally:
        for task in running.values():
            task.cancel()
        await asyncio.gather(*running.values(), return_exceptions=True)
