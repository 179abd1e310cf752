"""The routing benchmark's per-request gateway wait, read from the edge's ``Server-Timing``
(``regions/edge/observability.py`` writes it), its summary, and the engines' own step."""

from __future__ import annotations

import math

import pytest

from bench.harness.chat_client import Record, gateway_wait
from bench.harness.routing_report import targets
from bench.harness.routing_stats import metric_delta, summarise
from regions.edge.observability import server_timing
from regions.engines.metrics import EngineLoad


def test_the_gateway_wait_is_read_from_the_edges_own_header() -> None:
    assert gateway_wait(server_timing(0.0125, 0.001, 0.2).decode()) == pytest.approx(0.0125)
    assert gateway_wait("") == 0.0  # the oracle: no edge, no header


def test_the_summary_counts_the_wait_and_how_many_waited() -> None:
    records = [
        Record("s", 0, sent=1.0, ttft=0.2, e2e=1.0, status=200, queue_s=0.0),
        Record("s", 1, sent=2.0, ttft=0.3, e2e=1.0, status=200, queue_s=0.03),
        Record("t", 0, sent=99.0, ttft=0.3, e2e=1.0, status=200, queue_s=5.0),  # not counted
    ]
    result = summarise(records, 0.0, 10.0)
    assert result["gateway_wait_mean_s"] == pytest.approx(0.015)
    assert result["gateway_waited_share"] == 0.5


def test_the_summary_reports_inter_token_latency_over_the_tokens_after_the_first() -> None:
    """A placement that wins TTFT by slowing every stream's decode shows in ITL."""
    records = [
        Record("s", 0, sent=1.0, ttft=0.2, e2e=1.2, status=200, completion_tokens=11),
        Record("s", 1, sent=2.0, ttft=0.1, e2e=0.5, status=200, completion_tokens=5),
        Record("t", 0, sent=3.0, ttft=0.1, e2e=0.1, status=200, completion_tokens=1),  # no gap
    ]
    result = summarise(records, 0.0, 10.0)
    assert result["itl_mean_s"] == pytest.approx((0.1 + 0.1) / 2)
    assert result["e2e_mean_s"] == pytest.approx(0.6)


def test_the_engines_own_step_is_read_from_their_histograms_between_two_scrapes() -> None:
    """Beside the client's ITL: the engines' step per token, over all and per engine."""

    def load(itl_s: float, gaps: int, done: int = 0) -> EngineLoad:
        return EngineLoad(
            inter_token_latency_seconds_sum=itl_s,
            inter_token_latency_seconds_count=gaps,
            request_success_total=done,
            prefix_cache_queries_total=10 * done,
            prefix_cache_hits_total=9 * done,
        )

    before = [load(1.0, 100), load(5.0, 400)]
    after = [load(1.0 + 0.012 * 300, 400, 30), load(5.0 + 0.014 * 100, 500, 10)]
    delta = metric_delta(before, after)
    assert delta["requests_per_engine"] == [30, 10] and delta["max_engine_share"] == 0.75
    assert delta["hit_rate"] == pytest.approx(0.9)
    assert delta["engine_itl_mean_s"] == pytest.approx((0.012 * 300 + 0.014 * 100) / 400)
    assert delta["engine_itl_per_engine_s"] == [pytest.approx(0.012), pytest.approx(0.014)]
    idle = metric_delta(before, before)
    assert math.isnan(idle["engine_itl_mean_s"])


def test_a_placement_that_wins_ttft_by_slowing_decode_misses_the_itl_target() -> None:
    oracle = {"ttft_mean_s": 0.060, "hit_rate": 0.93, "itl_mean_s": 0.0130}
    faster_first_token = {"ttft_mean_s": 0.050, "hit_rate": 0.93, "itl_mean_s": 0.0135}
    judged = targets({"oracle": oracle, "fedinfer": faster_first_token})
    assert judged["mean_ttft_below_oracle_s"]["met"]
    assert judged["itl_above_oracle_ms"]["value"] == pytest.approx(0.5)
    assert not judged["itl_above_oracle_ms"]["met"]
    level = targets({"oracle": oracle, "fedinfer": {**faster_first_token, "itl_mean_s": 0.0131}})
    assert level["itl_above_oracle_ms"]["met"]
