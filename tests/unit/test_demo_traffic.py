"""The demo traffic generator's bookkeeping: where a request went, and the summary line."""

from __future__ import annotations

import pytest

from federation.demo.traffic import Window, clients_from, route_region

ENDPOINTS = {
    "edges": {"eu-west": "http://e", "us-east": "http://u"},
    "api_keys": {"globex-eu": "fi_g", "initech": "fi_i"},
    "tenants": {
        "globex-eu": {"regions": ["eu-west"]},
        "initech": {"regions": ["ap-southeast", "eu-west", "us-east"]},
    },
}


def test_served_region_is_the_route_headers_first_region() -> None:
    forwarded = "region=us-east;remote_from=eu-west;spill=not_local;rtt_ms=75;instance=i-1"
    assert route_region(forwarded) == "us-east"
    assert route_region("region=eu-west;instance=none;reason=saturated") == "eu-west"
    assert route_region("") == "?"


def test_each_tenant_sends_only_to_edges_of_its_permitted_regions() -> None:
    clients = {c.tenant: c for c in clients_from(ENDPOINTS)}
    assert clients["globex-eu"].edges == (("eu-west", "http://e"),)
    # ap-southeast is permitted but has no edge in this run: not a target.
    assert clients["initech"].edges == (("eu-west", "http://e"), ("us-east", "http://u"))
    assert clients["initech"].key == "fi_i"


def test_a_tenant_without_any_edge_is_an_error() -> None:
    bad = {**ENDPOINTS, "tenants": {"globex-eu": {"regions": ["eu-central"]}}}
    with pytest.raises(ValueError, match="globex-eu"):
        clients_from(bad)


def test_summary_line_counts_statuses_and_paths_per_tenant() -> None:
    w = Window()
    w.add("initech", True, "200", "eu-west>us-east")
    w.add("initech", False, "200", "us-east")
    w.add("globex-eu", False, "403", "eu-west:403")
    line = w.line()
    assert line.startswith("traffic 3 req (1 streamed) in ")
    assert line.endswith(
        " | 200=2 403=1 | globex-eu eu-west:403=1 | initech eu-west>us-east=1,us-east=1"
    )
