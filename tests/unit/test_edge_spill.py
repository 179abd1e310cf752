"""Spill-over choice: order from the table, residency filter, latency rule. Pure."""

from __future__ import annotations

from typing import Any

import msgspec

from regions.edge.policy.spill import (
    Remote,
    eligible_remotes,
    overflow_shares,
    ramp_point,
    ramping,
    returning_remotes,
    spill_plan,
)
from regions.tables.schema import Instance, decode_table


def table(**kw: Any) -> Any:
    doc: dict[str, Any] = {
        "schema_version": 1,
        "version": 1,
        "region": "us-east",
        "generated_at": "2026-11-29T09:00:00Z",
        "remote_regions": [
            {"code": "eu-west", "edge_url": "http://eu/", "rtt_ms": 80, "models": ["llama"],
             "headroom": 0.5},
            {"code": "us-west", "edge_url": "http://usw", "rtt_ms": 40, "models": ["llama", "qwen"],
             "headroom": 0.0},
        ],
        "routes": [
            {"model": "llama", "remotes": [
                {"code": "eu-west", "rtt_ms": 80, "headroom_tokens_per_s": 900},
                {"code": "gone", "rtt_ms": 10, "headroom_tokens_per_s": 900},
            ]},
        ],
    }  # fmt: skip
    doc.update(kw)
    return decode_table(msgspec.json.encode(doc))


def test_plan_keeps_route_order_then_other_remotes_by_rtt() -> None:
    plan = spill_plan(table())
    assert [r.code for r in plan["llama"]] == ["eu-west", "us-west"]
    assert plan["llama"][0] == Remote("eu-west", ("http://eu",), 0.08, True)
    assert plan["llama"][1].has_headroom is False
    assert [r.code for r in plan["qwen"]] == ["us-west"]
    assert spill_plan(table(remote_regions=[], routes=[])) == {}


def test_residency_is_hard_and_latency_needs_headroom_and_a_real_gain() -> None:
    remotes = spill_plan(table())["llama"]
    eu, usw = remotes
    # Nothing local: any allowed remote, headroom first.
    assert eligible_remotes(remotes, None, None, 0.05) == [eu, usw]
    assert eligible_remotes(remotes, frozenset({"us-west", "us-east"}), None, 0.05) == [usw]
    assert eligible_remotes(remotes, frozenset({"us-east"}), None, 0.05) == []
    # Local can serve: only when queue > RTT + margin, only remotes with headroom.
    assert eligible_remotes(remotes, None, 0.1, 0.05) == []
    assert eligible_remotes(remotes, None, 0.2, 0.05) == [eu]
    assert eligible_remotes(remotes, frozenset({"us-west"}), 5.0, 0.05) == []


def ramped(eu: float = 1.0, usw: float = 1.0, own: float = 1.0) -> Any:
    base = table()
    doc = msgspec.to_builtins(base)
    doc["schema_version"] = 2
    doc["ramp"] = own
    doc["remote_regions"][0]["ramp"] = eu
    doc["remote_regions"][1]["ramp"] = usw
    return decode_table(msgspec.json.encode(doc))


def test_ramp_point_is_stable_per_key_and_spread_over_the_unit_interval() -> None:
    assert ramp_point(b"session-1") == ramp_point(b"session-1")
    points = [ramp_point(f"s{i}".encode()) for i in range(2000)]
    assert all(0.0 <= p < 1.0 for p in points)
    below = sum(p < 0.3 for p in points) / len(points)
    assert 0.25 < below < 0.35


def test_a_remote_coming_back_takes_the_points_below_its_ramp_and_is_last_resort_above() -> None:
    t = ramped(eu=0.4)
    assert ramping(t) and not ramping(table())
    plan = spill_plan(t)
    assert plan["llama"][0].ramp == 0.4
    assert [r.code for r in eligible_remotes(plan["llama"], None, None, 0.0, 0.1)] == [
        "eu-west",
        "us-west",
    ]
    # Above its ramp: tried only after every other allowed remote (a ramp never refuses).
    assert [r.code for r in eligible_remotes(plan["llama"], None, None, 0.0, 0.7)] == [
        "us-west",
        "eu-west",
    ]
    # A latency spill goes there only within the ramp.
    assert [r.code for r in eligible_remotes(plan["llama"], None, 1.0, 0.05, 0.1)] == ["eu-west"]
    assert eligible_remotes(plan["llama"], None, 1.0, 0.05, 0.7) == []


def test_a_region_coming_back_sends_points_above_its_ramp_where_they_went_meanwhile() -> None:
    t = ramped(own=0.4)
    remotes = spill_plan(t)["llama"]
    assert returning_remotes(remotes, None, 0.1, t.ramp) == []  # within the ramp: stays
    assert [r.code for r in returning_remotes(remotes, None, 0.9, t.ramp)] == [
        "eu-west",
        "us-west",
    ]
    # Residency first: no allowed remote, served here whatever the ramp.
    assert returning_remotes(remotes, frozenset({"us-east"}), 0.9, t.ramp) == []
    # A remote that is itself coming back does not take points above its own ramp.
    both = ramped(own=0.4, eu=0.5, usw=0.5)
    assert returning_remotes(spill_plan(both)["llama"], None, 0.9, both.ramp) == []


def test_overflow_is_spread_over_the_models_instances_here() -> None:
    """What the edge sends away for want of capacity is reported beside the model's instances'
    queues, adding up to the count (the control plane sums a deployment's instances)."""
    llama = [Instance(id=f"l{i}", url=f"http://e:{i}", model="llama") for i in range(3)]
    by_model = {"llama": llama, "qwen": [Instance(id="q0", url="http://e:9", model="qwen")]}
    shares = overflow_shares({"llama": 5, "not-here": 3, "qwen": 0}, by_model)
    assert shares == {"l0": 2, "l1": 2, "l2": 1}
    assert overflow_shares({}, by_model) == {}
