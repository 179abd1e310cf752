"""The demo traffic generator's bookkeeping: where a request went, and the summary line."""

from __future__ import annotations

import pytest

from federation.demo.traffic import (
    NIGHT_SHARE,
    Day,
    Window,
    clients_from,
    day_share,
    region_clients,
    route_region,
)

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


def test_a_region_peaks_in_its_local_afternoon_and_is_quiet_at_night() -> None:
    # Singapore is UTC+7: its 15:00 is 08:00 UTC; Virginia (UTC-5) peaks at 20:00 UTC.
    assert day_share(8.0, 7.0) == pytest.approx(1.0)
    assert day_share(20.0, -5.0) == pytest.approx(1.0)
    assert day_share(20.0, 7.0) == pytest.approx(NIGHT_SHARE)  # 03:00 there
    shares = [day_share(h / 4, 0.0) for h in range(96)]
    assert min(shares) >= NIGHT_SHARE and max(shares) <= 1.0
    # rising through the morning, falling after the peak
    assert day_share(9.0, 0.0) < day_share(12.0, 0.0) < day_share(15.0, 0.0)
    assert day_share(15.0, 0.0) > day_share(18.0, 0.0) > day_share(21.0, 0.0)


def test_the_simulated_day_runs_at_its_pace_and_wraps() -> None:
    day = Day(minutes=10.0, start_hour=22.0)
    assert day.hour(0.0) == 22.0
    assert day.hour(25.0) == pytest.approx(23.0)  # 10 min per day: 25 s per hour
    assert day.hour(75.0) == pytest.approx(1.0)


def test_each_region_gets_the_clients_that_may_send_there() -> None:
    by_region = region_clients(clients_from(ENDPOINTS))
    assert {r: [c.tenant for c, _url in cs] for r, cs in by_region.items()} == {
        "eu-west": ["globex-eu", "initech"],
        "us-east": ["initech"],
    }
    assert by_region["us-east"][0][1] == "http://u"


def test_summary_line_carries_the_simulated_time_with_a_daily_pattern() -> None:
    w = Window(hour=14.5)
    w.add("initech", False, "200", "us-east")
    assert " at 14:30 UTC | 200=1 | initech us-east=1" in w.line()
