"""Spill-over choice: order from the table, residency filter, latency rule. Pure."""

from __future__ import annotations

from typing import Any

import msgspec

from regions.edge.spill import Remote, eligible_remotes, spill_plan
from regions.edge.table import decode_table


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
    assert plan["llama"][0] == Remote("eu-west", "http://eu", 0.08, True)
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
