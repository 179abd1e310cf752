"""Spill-over to other regions' edges: which remote may take a request, and when. Pure.

Built once per table (:func:`spill_plan`): for each model, the remote regions that serve it in
spill-over order — the order of ``routes[model].remotes`` (regions with headroom first, then
cheapest after the latency penalty), followed by any other ``remote_regions`` listing the model,
nearest first. Only regions present in ``remote_regions`` (they carry the edge URL) are kept; an
evacuated region is never there (the compiler leaves it out).

Per request (:func:`pick_remote`): the first remote the tenant's ``allowed_regions`` permit
(residency is hard: no allowed remote, no spill). When the model has a local candidate, the
remote must also have headroom and the local expected queue wait must exceed the remote's RTT
plus a margin: prefill costs about the same in both places, so TTFT_local > TTFT_remote + RTT
reduces to queue_local > RTT (+ margin against flapping between the two).

A region coming back (restored, or its instances back after all were lost) has a ``ramp`` below
1 in the tables (schema 2). Each request gets a point in [0, 1) from a hash of its session (or
of its body, without one: :func:`ramp_point`); a region at ramp *r* takes the requests whose
point is below *r*. Its own edge forwards the others to where they went while it was away
(:func:`returning_remotes`), other edges try it only for those points and otherwise use it last
(:func:`eligible_remotes`). As *r* rises in steps, sessions move to it in point order and stay:
the same point always lands on the same side, so a session does not bounce between regions.

What one request may do is its :class:`Spill`; forwarding it is ``spill_over.py``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import xxhash

from regions.edge.http.errors import EdgeError
from regions.tables.schema import Instance, RemoteRegion, RoutingTable

if TYPE_CHECKING:
    from regions.edge.policy.split import Split

_POINTS = float(2**64)


@dataclass(frozen=True, slots=True)
class Remote:
    code: str
    #: Its edges: the table's ``edge_url``, then its other live ``edges`` (schema 4).
    edge_urls: tuple[str, ...]
    rtt_s: float
    #: Capacity left there after the planned load (tokens/s; the region's share when the table
    #: has no per-model route).
    has_headroom: bool
    #: Share of the requests it takes while it comes back: those whose point is below it.
    ramp: float = 1.0


class Spill:
    """What forwarding one request to another region needs (only built when it may).

    ``targets``: where to try, in order, and ``why`` — set at admission when the request must
    go elsewhere first (not served here, residency, this region's ramp), else by the first
    placement when a remote would answer sooner (``place.py``).
    """

    __slots__ = (
        "allowed",
        "authorization",
        "overflow",
        "point",
        "remotes",
        "session",
        "split",
        "targets",
        "why",
    )

    def __init__(
        self,
        remotes: tuple[Remote, ...],
        allowed: frozenset[str] | None,
        authorization: bytes | None,
        session: bytes | None,
        point: float = 0.0,
        split: Split | None = None,
    ) -> None:
        self.remotes = remotes
        self.allowed = allowed
        #: The client's headers a remote edge needs again (its key; its session id).
        self.authorization = authorization
        self.session = session
        #: The request's place for regions coming back (:func:`ramp_point`).
        self.point = point
        #: The model's planned split of new sessions (split.py), when it has one.
        self.split = split
        self.targets: list[Remote] = []
        self.why = ""
        #: Sent away for want of local capacity (a remote answers sooner, or nothing here can
        #: take it), not by the plan, residency or a ramp: demand the autoscaler must see.
        self.overflow = False


def spill_plan(table: RoutingTable) -> dict[str, tuple[Remote, ...]]:
    """model -> remotes in spill-over order (see the module docstring)."""
    regions = {r.code: r for r in table.remote_regions}
    plan: dict[str, list[Remote]] = {}
    for route in table.routes:
        out = plan.setdefault(route.model, [])
        for target in route.remotes:
            region = regions.get(target.code)
            if region is None:
                continue
            out.append(
                Remote(
                    code=target.code,
                    edge_urls=_edge_urls(region),
                    rtt_s=(target.rtt_ms or region.rtt_ms) / 1000.0,
                    has_headroom=target.headroom_tokens_per_s > 0 or target.headroom > 0,
                    ramp=region.ramp,
                )
            )
    for region in sorted(table.remote_regions, key=lambda r: (r.rtt_ms, r.code)):
        for model in region.models:
            out = plan.setdefault(model, [])
            if all(r.code != region.code for r in out):
                out.append(
                    Remote(
                        code=region.code,
                        edge_urls=_edge_urls(region),
                        rtt_s=region.rtt_ms / 1000.0,
                        has_headroom=region.headroom > 0,
                        ramp=region.ramp,
                    )
                )
    return {model: tuple(remotes) for model, remotes in plan.items() if remotes}


def _edge_urls(region: RemoteRegion) -> tuple[str, ...]:
    return tuple(url.rstrip("/") for url in (region.edge_url, *region.edges))


def ramping(table: RoutingTable) -> bool:
    """Whether a region of this table is coming back (requests then need their point)."""
    return table.ramp < 1.0 or any(r.ramp < 1.0 for r in table.remote_regions)


def ramp_point(key: bytes) -> float:
    """A request's place in [0, 1) for ramps: stable for a key (its session, else its body)."""
    return xxhash.xxh3_64_intdigest(key) / _POINTS


def _headroom_first(remotes: list[Remote]) -> list[Remote]:
    return [r for r in remotes if r.has_headroom] + [r for r in remotes if not r.has_headroom]


def eligible_remotes(
    remotes: tuple[Remote, ...],
    allowed: frozenset[str] | None,
    local_queue_s: float | None,
    margin_s: float,
    point: float = 0.0,
) -> list[Remote]:
    """The remotes to try, in order; empty to stay local (or refuse).

    ``allowed``: the tenant's allowed regions (None: no tenants in the table, unrestricted).
    ``local_queue_s``: the local winner's expected queue wait; None when nothing local can
    take the request (model not here, region evacuated, no healthy instance, saturated): then
    every allowed remote qualifies, those with headroom first, and a region coming back whose
    ramp is at or below ``point`` only after all of them (a ramp steers; it never refuses). A
    latency spill goes only where the ramp admits the point.
    """
    permitted = [r for r in remotes if allowed is None or r.code in allowed]
    if local_queue_s is None:
        return _headroom_first([r for r in permitted if point < r.ramp]) + _headroom_first(
            [r for r in permitted if point >= r.ramp]
        )
    return [
        r
        for r in permitted
        if r.has_headroom and point < r.ramp and local_queue_s > r.rtt_s + margin_s
    ]


def returning_remotes(
    remotes: tuple[Remote, ...],
    allowed: frozenset[str] | None,
    point: float,
    local_ramp: float,
) -> list[Remote]:
    """Where a request goes instead of this region while it comes back (``local_ramp`` < 1):
    empty when its point is within the ramp, or when no allowed remote takes the point — then
    it is served here (residency and availability come before the ramp)."""
    if point < local_ramp:
        return []
    permitted = [r for r in remotes if (allowed is None or r.code in allowed) and point < r.ramp]
    return _headroom_first(permitted)


def first_targets(
    remotes: tuple[Remote, ...],
    allowed: frozenset[str] | None,
    *,
    local_ok: bool,
    here: bool,
    cold: bool,
    local_ramp: float,
    point: float,
) -> tuple[list[Remote], str] | None:
    """Where a request goes before this region is tried, and why (``Spill.why``): ``([], "")``
    to serve it here; None when neither here nor an allowed remote can take it (refused:
    :func:`refusal`). The edge's admit stage and the console's "where would it go" both ask.

    ``local_ok``: the tenant may be served in this region; ``here``: an instance here serves
    the model; ``cold``: it is deployed here but scaled to zero (held here unless a remote may
    take it now); ``local_ramp``: this region's ramp (below 1 while it comes back)."""
    if not local_ok or not here:
        targets = eligible_remotes(remotes, allowed, None, 0.0, point)
        if not targets:
            return ([], "") if cold and local_ok else None
        return targets, "cold" if cold and local_ok else "residency" if here else "not_local"
    # This region coming back: requests above its ramp go where they went meanwhile.
    back = returning_remotes(remotes, allowed, point, local_ramp)
    return back, "ramp" if back else ""


def refusal(
    region: str,
    model: str,
    tenant: tuple[str, frozenset[str]] | None,
    *,
    local_ok: bool,
    hopped: bool,
    served_elsewhere: bool,
    routed_here: bool,
    retry_after_s: int,
) -> EdgeError:
    """Why neither this region nor an allowed remote can take a request (:func:`first_targets`
    said None). ``tenant``: its slug and allowed regions; ``served_elsewhere``: another region
    of the table serves the model; ``routed_here``: this region's table routes it."""
    if not local_ok and tenant is not None:
        slug, allowed_regions = tenant
        allowed = ", ".join(sorted(allowed_regions)) or "none"
        return EdgeError(
            403,
            f"Tenant {slug!r} may not be served in region {region}, and no "
            f"region it allows ({allowed}) can take `{model}` from here.",
            "region_not_allowed",
        )
    if hopped and (routed_here or served_elsewhere):
        return EdgeError(
            503,
            f"Region {region} has no instance of `{model}` for a forwarded request.",
            "no_local_instance",
            retry_after=retry_after_s,
        )
    if served_elsewhere:
        # Served elsewhere, not in an allowed region now (a permanent residency refusal is
        # a 403 from the table's residency class, checked in admission).
        return EdgeError(
            503,
            f"No region this tenant may use can serve `{model}` from {region} now.",
            "no_allowed_region",
            retry_after=retry_after_s,
        )
    return EdgeError(
        404,
        f"The model `{model}` does not exist in region {region}.",
        "model_not_found",
        "model",
    )


def overflow_shares(
    overflow: Mapping[str, int], by_model: Mapping[str, Sequence[Instance]]
) -> dict[str, int]:
    """Instance id -> its share of the requests in flight in other regions for want of this
    region's capacity (model -> count), spread evenly over the model's instances here: the
    heartbeat reports them beside each instance's queue, so the control plane counts demand the
    region could not serve and scales for it."""
    shares: dict[str, int] = {}
    for model, count in overflow.items():
        instances = by_model.get(model, ())
        if count <= 0 or not instances:
            continue
        each, extra = divmod(count, len(instances))
        for i, inst in enumerate(instances):
            shares[inst.id] = shares.get(inst.id, 0) + each + (1 if i < extra else 0)
    return shares
