"""The routing benchmark's per-request gateway wait, read from the edge's ``Server-Timing``
(``regions/edge/observability.py`` writes it), and its summary."""

from __future__ import annotations

import pytest

from bench.chat_client import Record, gateway_wait
from bench.routing_stats import summarise
from regions.edge.observability import server_timing


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
