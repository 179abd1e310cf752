"""Carrying out the demand split: a stable share of a model's new sessions goes where the plan
says, not only where this region is full. Pure.

The compiler's demand split (``docs/demand-split.md``) gives each route a ``local_weight`` and a
``weight`` per remote region: the shares of this region's demand for the model that cost and
latency say each region should serve. Without this module the edge used those weights only to
order spill-over, so a cheaper region with headroom got nothing until this one was saturated.

Only a route with measured demand (``demand_tokens_per_s`` > 0) is split: without demand the
compiler names the cheapest region as a preference for spill-over order, not a share of traffic,
and a region's first requests stay where they arrived.

Each request has a *split point* in [0, 1), derived from its session (else its body) like the
ramp point (:func:`split_point`), so a session always lands on the same side. The served shares
are laid out over [0, 1) in the route's order — this region first, then each remote in
spill-over order — scaled to sum to 1 (a plan's unserved share is nobody's). A point in a
remote's interval is sent there (:func:`planned_remote`) when:

* the tenant may be served there — residency first: otherwise it is served here;
* the remote has headroom, and its ramp (a region coming back) admits the request's ramp point;
* its expected TTFT stays within ``margin_s`` of serving here: the prefill costs the same in
  both places, so RTT ≤ local expected queue wait + ``margin_s``;
* the request starts a session here (a session already on an instance here stays).

Otherwise it is served here, and the latency spill-over of ``spill.py`` still applies.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from regions.edge.policy.spill import Remote
from regions.tables.schema import RoutingTable

#: The split point is the ramp point's fraction at this scale: a second uniform number from the
#: same hash, independent of the first enough that a ramp and a split do not pick the same
#: sessions.
_SPLIT_SCALE = float(1 << 20)


@dataclass(frozen=True, slots=True)
class Share:
    """A remote region's interval of split points, [low, high)."""

    remote: Remote
    low: float
    high: float


@dataclass(frozen=True, slots=True)
class Split:
    """One model's plan at this edge: its own share, then the remotes' intervals."""

    local: float
    shares: tuple[Share, ...]


def split_plan(
    table: RoutingTable, spill: dict[str, tuple[Remote, ...]], local_models: set[str]
) -> dict[str, Split]:
    """model -> its split, for the models served here with a planned remote share."""
    plans = {}
    for route in table.routes:
        if route.model not in local_models:
            continue  # not served here: every request goes elsewhere anyway (spill.py)
        if route.demand_tokens_per_s <= 0:
            # No demand measured: the weights name the cheapest region for spill-over order,
            # they are not a split of traffic (an idle region keeps its first requests).
            continue
        remotes = {r.code: r for r in spill.get(route.model, ())}
        weighted = [
            (remotes[t.code], t.weight) for t in route.remotes if t.weight > 0 and t.code in remotes
        ]
        total = route.local_weight + sum(w for _, w in weighted)
        if not weighted or total <= 0:
            continue
        low = route.local_weight / total
        shares = []
        for remote, weight in weighted:
            high = low + weight / total
            shares.append(Share(remote, low, high))
            low = high
        plans[route.model] = Split(route.local_weight / total, tuple(shares))
    return plans


def split_point(ramp_point: float) -> float:
    """A request's split point in [0, 1), from its ramp point (see ``_SPLIT_SCALE``)."""
    return (ramp_point * _SPLIT_SCALE) % 1.0


def planned_remote(
    split: Split,
    point: float,
    ramp_point: float,
    allowed: frozenset[str] | None,
    local_queue_s: float,
    margin_s: float,
) -> Remote | None:
    """The remote the plan sends this request to, or None to serve it here (see the module)."""
    if point < split.local:
        return None
    for share in split.shares:
        if share.low <= point < share.high:
            remote = share.remote
            if (
                (allowed is None or remote.code in allowed)
                and remote.has_headroom
                and ramp_point < remote.ramp
                and remote.rtt_s <= local_queue_s + margin_s
            ):
                return remote
            return None
    return None


class SplitCounts:
    """New sessions the split decided, by model and the region they went to (this region's
    code for those kept here): what the realised shares are computed from."""

    __slots__ = ("counts",)

    def __init__(self) -> None:
        self.counts: dict[tuple[str, str], int] = {}

    def count(self, model: str, region: str) -> None:
        key = (model, region)
        self.counts[key] = self.counts.get(key, 0) + 1


class SplitCollector(Collector):
    """Planned and realised shares at scrape time: ``fedinfer_edge_split_planned_share`` from
    the table, ``fedinfer_edge_split_sessions_total`` counted per decision (realised share =
    a region's rate over the model's)."""

    def __init__(
        self, region: str, counts: SplitCounts, plans: Callable[[], Mapping[str, Split]]
    ) -> None:
        self.region = region
        self.counts = counts
        self.plans = plans

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        planned = GaugeMetricFamily(
            "fedinfer_edge_split_planned_share",
            "Share of a model's new sessions the table's demand split plans for each region",
            labels=["model", "region"],
        )
        for model, split in sorted(self.plans().items()):
            planned.add_metric([model, self.region], split.local)
            for share in split.shares:
                planned.add_metric([model, share.remote.code], share.high - share.low)
        yield planned
        sessions = CounterMetricFamily(
            "fedinfer_edge_split_sessions",
            "New sessions of split models, by the region the edge sent them to",
            labels=["model", "region"],
        )
        for (model, region), n in sorted(self.counts.counts.items()):
            sessions.add_metric([model, region], n)
        yield sessions
