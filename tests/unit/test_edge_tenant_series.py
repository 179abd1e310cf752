"""The edge's per-tenant series stay bounded (``observability.TenantSeries``), and the inter-token
latency histogram keeps plain counts."""

from __future__ import annotations

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from regions.edge.observability import OTHER_TENANTS, EdgeMetrics, TenantSeries


def tenant_values(metrics: EdgeMetrics) -> set[str]:
    text = generate_latest(metrics.registry).decode()
    return {
        s.labels["tenant"]
        for family in text_string_to_metric_families(text)
        if family.name.startswith("fedinfer_edge_tenant_")
        for s in family.samples
    }


def test_a_flood_of_distinct_tenants_never_exceeds_top_plus_one_label_values() -> None:
    metrics = EdgeMetrics(tenant_series=5)
    series = metrics.tenants
    for i in range(10_000):
        series.observe(f"t{i}", 200, 0.01, 10, 2, 0)
        if i % 1000 == 0:
            assert len(tenant_values(metrics)) <= 6
    assert len(tenant_values(metrics)) == 6
    assert OTHER_TENANTS in tenant_values(metrics)
    # Memory is bounded too: past its capacity a new tenant goes straight to (other).
    assert len(series.tallies) == series.capacity == 8 * 5 + 64
    exported = dict(series.exported())
    assert sum(t.requests for t in exported.values()) == 10_000
    assert sum(t.prompt for t in exported.values()) == 100_000


def test_the_top_tenants_by_requests_get_their_own_series() -> None:
    series = TenantSeries(top=2)
    for tenant, n in (("small", 1), ("big", 5), ("mid", 3), ("tiny", 1)):
        for _ in range(n):
            series.observe(tenant, 200, 0.05, 100, 10, 50)
    series.observe("small", 429, None, None, None, None)
    out = series.exported()
    assert [name for name, _ in out] == ["big", "mid", OTHER_TENANTS]
    other = out[2][1]
    assert other.requests == 3 and other.statuses == {200: 2, 429: 1}
    assert (other.prompt, other.completion, other.cached) == (200, 20, 100)
    assert sum(other.ttft.counts) == 2


def test_zero_top_tenants_counts_everyone_as_other() -> None:
    series = TenantSeries(top=0)
    series.observe("a", 200, None, None, None, None)
    assert [name for name, _ in series.exported()] == [OTHER_TENANTS]


def test_inter_token_latency_is_exported_per_model() -> None:
    metrics = EdgeMetrics()
    itl = metrics.itl_histo("llama")
    assert metrics.itl_histo("llama") is itl
    for gap in (0.004, 0.02, 0.02, 3.0):
        itl.observe(gap)
    text = generate_latest(metrics.registry).decode()
    samples = {
        (s.name, s.labels.get("le")): s.value
        for family in text_string_to_metric_families(text)
        if family.name == "fedinfer_edge_inter_token_latency_seconds"
        for s in family.samples
    }
    assert samples[("fedinfer_edge_inter_token_latency_seconds_count", None)] == 4
    assert samples[("fedinfer_edge_inter_token_latency_seconds_bucket", "0.005")] == 1
    assert samples[("fedinfer_edge_inter_token_latency_seconds_bucket", "0.02")] == 3
    assert samples[("fedinfer_edge_inter_token_latency_seconds_bucket", "+Inf")] == 4
