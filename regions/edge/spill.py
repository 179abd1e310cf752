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
"""

from __future__ import annotations

from dataclasses import dataclass

from regions.edge.table import RoutingTable


@dataclass(frozen=True, slots=True)
class Remote:
    code: str
    edge_url: str
    rtt_s: float
    #: Capacity left there after the planned load (tokens/s; the region's share when the table
    #: has no per-model route).
    has_headroom: bool


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
                    edge_url=region.edge_url.rstrip("/"),
                    rtt_s=(target.rtt_ms or region.rtt_ms) / 1000.0,
                    has_headroom=target.headroom_tokens_per_s > 0 or target.headroom > 0,
                )
            )
    for region in sorted(table.remote_regions, key=lambda r: (r.rtt_ms, r.code)):
        for model in region.models:
            out = plan.setdefault(model, [])
            if all(r.code != region.code for r in out):
                out.append(
                    Remote(
                        code=region.code,
                        edge_url=region.edge_url.rstrip("/"),
                        rtt_s=region.rtt_ms / 1000.0,
                        has_headroom=region.headroom > 0,
                    )
                )
    return {model: tuple(remotes) for model, remotes in plan.items() if remotes}


def eligible_remotes(
    remotes: tuple[Remote, ...],
    allowed: frozenset[str] | None,
    local_queue_s: float | None,
    margin_s: float,
) -> list[Remote]:
    """The remotes to try, in order; empty to stay local (or refuse).

    ``allowed``: the tenant's allowed regions (None: no tenants in the table, unrestricted).
    ``local_queue_s``: the local winner's expected queue wait; None when nothing local can
    take the request (model not here, region evacuated, no healthy instance, saturated): then
    every allowed remote qualifies, those with headroom first.
    """
    permitted = [r for r in remotes if allowed is None or r.code in allowed]
    if local_queue_s is None:
        return [r for r in permitted if r.has_headroom] + [
            r for r in permitted if not r.has_headroom
        ]
    return [r for r in permitted if r.has_headroom and local_queue_s > r.rtt_s + margin_s]
