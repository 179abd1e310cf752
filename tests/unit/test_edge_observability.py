"""Route explanation, Server-Timing and W3C trace context; the CLI's flags."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from regions.edge.cli import build_parser, config_from_args
from regions.edge.observability import EdgeMetrics, child_traceparent, server_timing

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"


def test_a_valid_caller_trace_is_continued_with_a_new_span() -> None:
    trace_id, parent = child_traceparent(f"00-{TRACE}-00f067aa0ba902b7-01")
    assert trace_id == TRACE
    version, tid, span, flags = parent.split("-")
    assert (version, tid, flags) == ("00", TRACE, "01")
    assert len(span) == 16 and span != "00f067aa0ba902b7"


@pytest.mark.parametrize(
    "bad",
    [
        None,
        "",
        "garbage",
        f"ff-{TRACE}-00f067aa0ba902b7-01",
        f"00-{'0' * 32}-00f067aa0ba902b7-01",
        f"00-{TRACE}-{'0' * 16}-01",
        f"00-{TRACE[:-1]}g-00f067aa0ba902b7-01",
    ],
)
def test_an_invalid_or_missing_trace_starts_a_new_one(bad: str | None) -> None:
    trace_id, parent = child_traceparent(bad)
    assert trace_id != TRACE and len(trace_id) == 32
    assert parent.startswith(f"00-{trace_id}-") and parent.endswith("-01")


def test_server_timing() -> None:
    assert server_timing(0.001, 0.0005, 0.02) == b"queue;dur=1.00, connect;dur=0.50, ttft;dur=20.00"
    assert server_timing(0.0, None, None) == b"queue;dur=0.00"


def test_cli_flags_reach_the_config(tmp_path: Path) -> None:
    opts = build_parser().parse_args(
        [
            "--region", "eu", "--table", str(tmp_path / "t.json"), "--policy", "least_loaded",
            "--max-body-bytes", "1000", "--queue-size", "3", "--queue-timeout", "0.5",
            "--eject-after", "4", "--readmit-after", "5", "--affinity-margin-ms", "20",
        ]
    )  # fmt: skip
    cfg = config_from_args(opts)
    assert cfg.region == "eu" and cfg.scheduler.policy == "least_loaded"
    assert cfg.max_body_bytes == 1000 and cfg.queue_size == 3 and cfg.queue_timeout_s == 0.5
    assert cfg.health.eject_after == 4 and cfg.health.readmit_after == 5
    assert cfg.scheduler.affinity_margin_s == pytest.approx(0.02)
    assert build_parser().parse_args(["--region", "r", "--table", "t"]).policy == "fedinfer"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--region", "r", "--table", "t", "--policy", "random"])


def test_per_request_series_are_exported_in_prometheus_shape() -> None:
    m = EdgeMetrics()
    s = m.series("llama", "i-1")
    for value in (0.003, 0.02, 0.02, 7.0, 500.0):
        s.ttft.observe(value)
    s.actual_cached += 256
    m.count("llama", "i-1", 200)
    m.count("llama", "i-1", 200)
    m.count("", "", 401)  # refused before routing: counted, not timed
    m.inflight["i-1"] = 3
    families = {
        f.name: f for f in text_string_to_metric_families(generate_latest(m.registry).decode())
    }
    requests = {
        (x.labels["instance"], x.labels["status"]): x.value
        for x in families["fedinfer_edge_requests"].samples
    }
    assert requests == {("i-1", "200"): 2.0, ("", "401"): 1.0}
    buckets = {
        x.labels["le"]: x.value
        for x in families["fedinfer_edge_ttft_seconds"].samples
        if x.name.endswith("_bucket")
    }
    assert (buckets["0.005"], buckets["0.025"], buckets["5.0"], buckets["10.0"]) == (1, 3, 3, 4)
    assert buckets["120.0"] == 4 and buckets["+Inf"] == 5
    total = [x for x in families["fedinfer_edge_ttft_seconds"].samples if x.name.endswith("_sum")]
    assert total[0].value == pytest.approx(507.043)
    assert families["fedinfer_edge_actual_cached_tokens"].samples[0].value == 256
    assert families["fedinfer_edge_inflight"].samples[0].value == 3
