"""W3C trace context, ``Server-Timing``, a tenant's view of the cache, and the edge's metrics.

Every response says how long each hop took (``Server-Timing``) and carries a ``traceparent``
that the upstream engine also received; which path it took is ``route.py``'s header.
"""

from __future__ import annotations

import random
from bisect import bisect_left
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, replace

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from regions.edge.policy.scheduler import Scored

_HEX = frozenset("0123456789abcdef")
_rand = random.getrandbits  # trace ids need uniqueness, not secrecy


def _is_hex(value: str, length: int, nonzero: bool = True) -> bool:
    return len(value) == length and set(value) <= _HEX and not (nonzero and value.strip("0") == "")


def child_traceparent(incoming: str | None) -> tuple[str, str]:
    """(trace id, traceparent for the upstream hop): keep a valid caller trace, else start one."""
    if incoming:
        parts = incoming.strip().lower().split("-")
        if (
            len(parts) >= 4
            and _is_hex(parts[0], 2, nonzero=False)
            and parts[0] != "ff"
            and _is_hex(parts[1], 32)
            and _is_hex(parts[2], 16)
            and _is_hex(parts[3], 2, nonzero=False)
        ):
            trace_id, flags = parts[1], parts[3]
            return trace_id, f"00-{trace_id}-{_rand(64) or 1:016x}-{flags}"
    trace_id = f"{_rand(128) or 1:032x}"
    return trace_id, f"00-{trace_id}-{_rand(64) or 1:016x}-01"


@dataclass(frozen=True, slots=True)
class CacheView:
    """What one tenant may be shown of the prefix cache: at most ``own_cached`` tokens (what
    it sent itself, :class:`~regions.edge.policy.prefix_index.SeenPrefixes`). Tokens cached by other
    tenants' prompts are shown as uncached, their prefill time at the instance's ``rates``."""

    own_cached: int
    rates: Mapping[str, float]

    def shown(self, s: Scored) -> Scored:
        hidden = s.cached_tokens - self.own_cached
        if hidden <= 0:
            return s
        rate = self.rates.get(s.instance, 0.0)
        extra = hidden / rate if rate > 0 else 0.0
        return replace(
            s,
            ttft_s=s.ttft_s + extra,
            prefill_s=s.prefill_s + extra,
            cached_tokens=self.own_cached,
        )


def server_timing(queue_s: float, connect_s: float | None, ttft_s: float | None) -> bytes:
    parts = [f"queue;dur={queue_s * 1000:.2f}"]
    if connect_s is not None:
        parts.append(f"connect;dur={connect_s * 1000:.2f}")
    if ttft_s is not None:
        parts.append(f"ttft;dur={ttft_s * 1000:.2f}")
    return ", ".join(parts).encode()


_LATENCY_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
)  # fmt: skip


#: Inter-token latency: the gaps between a stream's chunks, milliseconds to a stalled second.
_ITL_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5,
)  # fmt: skip


class Histo:
    """A histogram as plain fields: the per-observation cost is one bisect and two adds."""

    __slots__ = ("bounds", "counts", "total")

    def __init__(self, bounds: tuple[float, ...] = _LATENCY_BUCKETS) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last one is +Inf
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.total += value

    def add(self, other: Histo) -> None:
        """Fold ``other`` (same bounds) into this one."""
        self.counts = [a + b for a, b in zip(self.counts, other.counts, strict=True)]
        self.total += other.total

    def buckets(self) -> list[tuple[str, float]]:
        out: list[tuple[str, float]] = []
        running = 0
        for bound, count in zip((*self.bounds, float("inf")), self.counts, strict=True):
            running += count
            out.append(("+Inf" if bound == float("inf") else repr(bound), running))
        return out


class Series:
    """What the edge counts per (model, instance) on every request, in plain fields.

    prometheus_client's metric objects take a lock and check their state on each update
    (~1.5 µs apiece, eight per request); these are exported by :class:`_RequestCollector`
    when /metrics is scraped instead.
    """

    __slots__ = (
        "actual_cached",
        "e2e",
        "predicted_cached",
        "predictions",
        "prompt_tokens",
        "statuses",
        "ttft",
    )

    def __init__(self) -> None:
        self.ttft = Histo()
        self.e2e = Histo()
        self.predicted_cached = 0
        self.actual_cached = 0
        self.prompt_tokens = 0
        self.statuses: dict[int, int] = {}
        #: (path, outcome) -> requests: how the predicted cached tokens compared with the
        #: engine's report, by whether the prediction was exact (KV events) or an estimate.
        self.predictions: dict[tuple[str, str], int] = {}

    def compare(self, exact: bool, predicted: int, reported: int) -> None:
        outcome = "equal" if predicted == reported else "over" if predicted > reported else "under"
        key = ("exact" if exact else "estimate", outcome)
        self.predictions[key] = self.predictions.get(key, 0) + 1


#: The label value of the tenants without series of their own (never a tenant's slug: slugs
#: are letters, digits, ``-`` and ``_``).
OTHER_TENANTS = "(other)"


class TenantTally:
    """One tenant's requests (by status), tokens and TTFT, in plain fields."""

    __slots__ = ("cached", "completion", "prompt", "requests", "statuses", "ttft")

    def __init__(self) -> None:
        self.requests = 0
        self.statuses: dict[int, int] = {}
        self.prompt = 0
        self.completion = 0
        self.cached = 0
        self.ttft = Histo()

    def add(self, other: TenantTally) -> None:
        self.requests += other.requests
        for status, n in other.statuses.items():
            self.statuses[status] = self.statuses.get(status, 0) + n
        self.prompt += other.prompt
        self.completion += other.completion
        self.cached += other.cached
        self.ttft.add(other.ttft)


class TenantSeries:
    """Per-tenant series with bounded cardinality: at a scrape, the ``top`` tenants by requests
    have a ``tenant`` label value of their own and every other one is summed as
    :data:`OTHER_TENANTS`, so there are never more than ``top + 1`` values however many
    tenants send requests.

    Who is in the top follows the running totals, so it settles; when it changes, the promoted
    tenant's series starts with its whole count and the ``(other)`` series drops by as much
    (Prometheus reads that as a counter reset). At most ``capacity`` tenants are tallied one by
    one; past that, new tenants are counted straight into ``(other)``.
    """

    __slots__ = ("capacity", "overflow", "tallies", "top")

    def __init__(self, top: int, capacity: int | None = None) -> None:
        self.top = top
        self.capacity = capacity if capacity is not None else 8 * top + 64
        self.tallies: dict[str, TenantTally] = {}
        self.overflow = TenantTally()

    def observe(
        self,
        tenant: str,
        status: int,
        ttft_s: float | None,
        prompt: int | None,
        completion: int | None,
        cached: int | None,
    ) -> None:
        """One answered request of ``tenant``; None: the engine did not say."""
        tally = self.tallies.get(tenant)
        if tally is None:
            if len(self.tallies) < self.capacity:
                tally = self.tallies[tenant] = TenantTally()
            else:
                tally = self.overflow
        tally.requests += 1
        statuses = tally.statuses
        statuses[status] = statuses.get(status, 0) + 1
        if ttft_s is not None:
            tally.ttft.observe(ttft_s)
        if prompt is not None:
            tally.prompt += prompt
        if completion is not None:
            tally.completion += completion
        if cached is not None:
            tally.cached += cached

    def exported(self) -> list[tuple[str, TenantTally]]:
        """(label value, tally) of the top tenants, then the rest summed as ``(other)``."""
        ranked = sorted(self.tallies.items(), key=lambda kv: (-kv[1].requests, kv[0]))
        out = ranked[: self.top]
        rest = TenantTally()
        rest.add(self.overflow)
        for _, tally in ranked[self.top :]:
            rest.add(tally)
        if rest.requests:
            out.append((OTHER_TENANTS, rest))
        return out


class _RequestCollector(Collector):
    """Exports the per-request series (and in-flight counts) in Prometheus' usual shape."""

    def __init__(self, metrics: EdgeMetrics) -> None:
        self.m = metrics

    def collect(self) -> Iterator[Metric]:
        yield from self._request_series()
        yield from self._stream_series()
        yield from self._tenant_series()
        yield from self._server_state()

    def _stream_series(self) -> Iterator[Metric]:
        itl = HistogramMetricFamily(
            "fedinfer_edge_inter_token_latency_seconds",
            "Gaps between the chunks of a stream the edge relays, by model",
            labels=["model"],
        )
        for model, h in self.m.itl.items():
            itl.add_metric([model], h.buckets(), h.total)
        yield itl

    def _tenant_series(self) -> Iterator[Metric]:
        requests = CounterMetricFamily(
            "fedinfer_edge_tenant_requests",
            "Requests admitted, by tenant (the top tenants by requests; the rest as "
            f"{OTHER_TENANTS}) and HTTP status",
            labels=["tenant", "status"],
        )
        tokens = CounterMetricFamily(
            "fedinfer_edge_tenant_tokens",
            "Tokens the engines reported, by tenant and kind (prompt, completion, cached)",
            labels=["tenant", "kind"],
        )
        ttft = HistogramMetricFamily(
            "fedinfer_edge_tenant_ttft_seconds",
            "Edge arrival to the first byte of the upstream response body, by tenant",
            labels=["tenant"],
        )
        for tenant, tally in self.m.tenants.exported():
            for status, n in tally.statuses.items():
                requests.add_metric([tenant, str(status)], n)
            tokens.add_metric([tenant, "prompt"], tally.prompt)
            tokens.add_metric([tenant, "completion"], tally.completion)
            tokens.add_metric([tenant, "cached"], tally.cached)
            ttft.add_metric([tenant], tally.ttft.buckets(), tally.ttft.total)
        yield from (requests, tokens, ttft)

    def _request_series(self) -> Iterator[Metric]:
        series = self.m.all_series
        labels = ["model", "instance"]
        requests = CounterMetricFamily(
            "fedinfer_edge_requests",
            "Requests answered, by model, instance and HTTP status",
            labels=[*labels, "status"],
        )
        ttft = HistogramMetricFamily(
            "fedinfer_edge_ttft_seconds",
            "Edge arrival to the first byte of the upstream response body",
            labels=labels,
        )
        e2e = HistogramMetricFamily(
            "fedinfer_edge_request_duration_seconds",
            "Edge arrival to the last byte sent to the client",
            labels=labels,
        )
        predicted = CounterMetricFamily(
            "fedinfer_edge_predicted_cached_tokens",
            "Prompt tokens the scheduler expected the engine to have cached",
            labels=labels,
        )
        actual = CounterMetricFamily(
            "fedinfer_edge_actual_cached_tokens",
            "Prompt tokens the engine reported cached (usage.prompt_tokens_details.cached_tokens)",
            labels=labels,
        )
        prompt = CounterMetricFamily(
            "fedinfer_edge_prompt_tokens",
            "Prompt tokens the engine reported (usage.prompt_tokens)",
            labels=labels,
        )
        agreement = CounterMetricFamily(
            "fedinfer_edge_cached_predictions",
            "Requests by how the predicted cached tokens compared with the engine's report "
            "(outcome equal, over, under), and whether the prediction was exact (KV events "
            "and the model's tokenizer) or the byte estimate",
            labels=[*labels, "path", "outcome"],
        )
        for (model, instance), s in series.items():
            key = [model, instance]
            for status, n in s.statuses.items():
                requests.add_metric([*key, str(status)], n)
            if not instance:
                continue  # refused before an instance was chosen: counted, nothing timed
            ttft.add_metric(key, s.ttft.buckets(), s.ttft.total)
            e2e.add_metric(key, s.e2e.buckets(), s.e2e.total)
            predicted.add_metric(key, s.predicted_cached)
            actual.add_metric(key, s.actual_cached)
            prompt.add_metric(key, s.prompt_tokens)
            for (path, outcome), n in s.predictions.items():
                agreement.add_metric([*key, path, outcome], n)
        yield from (requests, ttft, e2e, predicted, actual, prompt, agreement)

    def _server_state(self) -> Iterator[Metric]:
        inflight = GaugeMetricFamily(
            "fedinfer_edge_inflight", "Requests in flight per instance", labels=["instance"]
        )
        for instance, n in self.m.inflight.items():
            inflight.add_metric([instance], n)
        refusals = CounterMetricFamily(
            "fedinfer_edge_http_refusals",
            "Client connections or requests the edge's HTTP server refused or cut, by reason "
            "(head too large or too slow, body stalled, client not reading, connection cap, "
            "malformed or ambiguous framing)",
            labels=["reason"],
        )
        for reason, n in self.m.http_refusals.items():
            refusals.add_metric([reason], n)
        connections = GaugeMetricFamily(
            "fedinfer_edge_open_connections", "Client connections open on the public port"
        )
        connections.add_metric([], self.m.open_connections())
        yield from (inflight, refusals, connections)


class EdgeMetrics:
    """The edge's metrics in a registry of its own (several edges may share a test process)."""

    def __init__(self, tenant_series: int = 20) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        #: Per-request series, exported by a collector at scrape time.
        self.all_series: dict[tuple[str, str], Series] = {}
        #: Inter-token latency per model (the relay's chunk gaps).
        self.itl: dict[str, Histo] = {}
        #: Per-tenant series, at most ``tenant_series`` + 1 label values.
        self.tenants = TenantSeries(tenant_series)
        #: Requests in flight per instance.
        self.inflight: dict[str, int] = {}
        #: The public HTTP server's refusal counts by reason, and its open connections (set by
        #: whoever serves the edge: ``cli.serve``).
        self.http_refusals: dict[str, int] = {}
        self.open_connections: Callable[[], int] = lambda: 0
        r.register(_RequestCollector(self))
        self.retries = Counter(
            "fedinfer_edge_retries", "Requests re-sent to another instance", ["model"], registry=r
        )
        self.ejections = Counter(
            "fedinfer_edge_ejections",
            "Instances ejected by health checks",
            ["instance"],
            registry=r,
        )
        self.cold = Counter(
            "fedinfer_edge_cold_requests",
            "Requests for models scaled to zero, by outcome: released (served once a replica "
            "was ready), refused (line full, held too long, or the model gone), spilled (to "
            "another region), left (the client disconnected while held)",
            ["model", "outcome"],
            registry=r,
        )
        self.queue_depth = Gauge(
            "fedinfer_edge_queue_depth", "Requests waiting at the gateway for capacity", registry=r
        )
        self.spills = Counter(
            "fedinfer_edge_spills",
            "Requests forwarded to another region's edge, by region and reason",
            ["region", "reason"],
            registry=r,
        )
        self.midstream_failures = Counter(
            "fedinfer_edge_midstream_failures",
            "Streams cut by the upstream after the first byte",
            ["instance"],
            registry=r,
        )
        self.continuations = Counter(
            "fedinfer_edge_continuations",
            "Streams whose engine failed (or was drained) after the first byte, by why and what "
            "became of them: continued on another instance, ended (its answer was complete), "
            "or cut (with the reason it could not be continued)",
            ["model", "reason", "outcome"],
            registry=r,
        )
        self.scrape_failures = Counter(
            "fedinfer_edge_scrape_failures",
            "Engine /metrics scrapes that failed or did not parse",
            ["instance"],
            registry=r,
        )
        self.table_version = Gauge(
            "fedinfer_edge_table_version", "Version of the routing table in use", registry=r
        )
        self.table_rejections = Counter(
            "fedinfer_edge_table_rejections", "New routing tables refused", registry=r
        )
        self.healthy_instances = Gauge(
            "fedinfer_edge_healthy_instances", "Instances currently admitted", registry=r
        )

    def series(self, model: str, instance: str) -> Series:
        key = (model, instance)
        found = self.all_series.get(key)
        if found is None:
            found = self.all_series[key] = Series()
        return found

    def itl_histo(self, model: str) -> Histo:
        found = self.itl.get(model)
        if found is None:
            found = self.itl[model] = Histo(_ITL_BUCKETS)
        return found

    def count(self, model: str, instance: str, status: int) -> None:
        """One answered request."""
        statuses = self.series(model, instance).statuses
        statuses[status] = statuses.get(status, 0) + 1
