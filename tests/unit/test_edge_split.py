"""The split plan (pure): the plan's shares laid out over [0, 1), and who may be sent where."""

from __future__ import annotations

import dataclasses

import pytest

from regions.edge.policy.spill import ramp_point, spill_plan
from regions.edge.policy.split import Split, planned_remote, split_plan, split_point
from regions.tables.schema import (
    SCHEMA_VERSION,
    Instance,
    ModelRoute,
    RemoteRegion,
    RouteTarget,
    RoutingTable,
)


def table(
    local_weight: float, *weights: tuple[str, float], headroom: float = 0.5, demand: float = 900.0
) -> RoutingTable:
    return RoutingTable(
        schema_version=SCHEMA_VERSION,
        version=1,
        region="eu-1",
        generated_at="2026-12-01T00:00:00Z",
        instances=(Instance(id="i", url="http://i", model="llama"),),
        remote_regions=tuple(
            RemoteRegion(
                code=c, edge_url=f"http://{c}", rtt_ms=20.0, models=("llama",), headroom=headroom
            )
            for c, _ in weights
        ),
        routes=(
            ModelRoute(
                model="llama",
                demand_tokens_per_s=demand,
                local_weight=local_weight,
                remotes=tuple(
                    RouteTarget(code=c, weight=w, rtt_ms=20.0, headroom=headroom)
                    for c, w in weights
                ),
            ),
        ),
    )


def plan(t: RoutingTable) -> dict[str, Split]:
    return split_plan(t, spill_plan(t), {"llama"})


def test_the_served_shares_are_laid_out_in_route_order_and_scaled_to_one() -> None:
    [(model, split)] = plan(table(0.4, ("us-1", 0.2), ("eu-2", 0.2))).items()
    assert model == "llama" and split.local == pytest.approx(0.5)  # a fifth was unserved
    assert [(s.remote.code, s.low, s.high) for s in split.shares] == [
        ("us-1", pytest.approx(0.5), pytest.approx(0.75)),
        ("eu-2", pytest.approx(0.75), pytest.approx(1.0)),
    ]


def test_no_split_without_a_remote_weight_a_local_instance_or_demand() -> None:
    assert plan(table(1.0, ("us-1", 0.0))) == {}
    assert plan(table(0.0, ("us-1", 1.0), demand=0.0)) == {}  # a preference, not a split
    t = table(0.5, ("us-1", 0.5))
    assert split_plan(t, spill_plan(t), set()) == {}  # not served here: spill.py sends it all


def test_sessions_spread_over_the_shares_in_proportion() -> None:
    [split] = plan(table(0.5, ("us-1", 0.3), ("eu-2", 0.2))).values()
    counts = {"here": 0, "us-1": 0, "eu-2": 0}
    n = 20_000
    for i in range(n):
        rp = ramp_point(f"session-{i}".encode())
        remote = planned_remote(split, split_point(rp), rp, None, 0.0, 0.1)
        counts[remote.code if remote else "here"] += 1
    assert counts["here"] / n == pytest.approx(0.5, abs=0.01)
    assert counts["us-1"] / n == pytest.approx(0.3, abs=0.01)
    assert counts["eu-2"] / n == pytest.approx(0.2, abs=0.01)


def at(split: Split, code: str) -> float:
    """A split point inside ``code``'s interval."""
    share = next(s for s in split.shares if s.remote.code == code)
    return (share.low + share.high) / 2


@pytest.mark.parametrize(
    ("allowed", "queue_s", "margin_s", "ramp_point", "sent"),
    [
        (None, 0.0, 0.1, 0.0, True),
        (frozenset({"eu-1"}), 0.0, 0.1, 0.0, False),  # residency first
        (None, 0.0, 0.01, 0.0, False),  # 20 ms RTT is beyond the local wait + 10 ms
        (None, 0.015, 0.01, 0.0, True),  # ... unless the local queue makes up for it
        (None, 0.0, 0.1, 0.9, False),  # the remote's ramp (0.5) does not admit this point
    ],
)
def test_a_planned_remote_takes_the_session_only_when_it_may(
    allowed: frozenset[str] | None, queue_s: float, margin_s: float, ramp_point: float, sent: bool
) -> None:
    split = plan(table(0.5, ("us-1", 0.5)))["llama"]
    if ramp_point:  # us-1 is coming back, at half its traffic
        [share] = split.shares
        returning = dataclasses.replace(share.remote, ramp=0.5)
        split = Split(split.local, (dataclasses.replace(share, remote=returning),))
    got = planned_remote(split, at(split, "us-1"), ramp_point, allowed, queue_s, margin_s)
    assert (got is not None) == sent


def test_a_remote_without_headroom_gets_no_planned_share() -> None:
    split = plan(table(0.5, ("us-1", 0.5), headroom=0.0))["llama"]
    assert planned_remote(split, at(split, "us-1"), 0.0, None, 0.0, 0.1) is None
