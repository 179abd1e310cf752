"""The edge's inter-token latency and per-tenant series, scraped from a real edge process's
operator ``/metrics`` after requests through it to a fake engine: twelve tenants, the three
busiest with series of their own (``--tenant-series 3``), the rest as ``(other)``."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from regions.edge.observability import OTHER_TENANTS
from regions.supervisor import wait_http
from tests.integration.test_edge_support import instance, spawn_engine, start_edge, table_doc

TENANTS = [f"t{i:02d}" for i in range(12)]
#: Requests per tenant: t00 4, t01 3, t02 2, every other one 1.
SENT = {t: max(1, 4 - i) for i, t in enumerate(TENANTS)}


def key(tenant: str) -> str:
    return f"fi_{tenant}"


def test_tenant_series_are_bounded_and_itl_is_measured(tmp_path: Path) -> None:
    engine = spawn_engine(tmp_path, "i-1", "--tokens", "5", "--token-delay", "0.1")
    try:
        wait_http(engine.url + "/health", watch=engine.proc)
        doc = table_doc("r1", 1, [instance(engine)])
        doc["tenants"] = [
            {"tenant": t, "key_hashes": [hashlib.sha256(key(t).encode()).hexdigest()],
             "allowed_regions": ["r1"]}
            for t in TENANTS
        ]  # fmt: skip
        edge = start_edge(tmp_path, doc, "--tenant-series", "3")
        try:
            for tenant, n in SENT.items():
                for _ in range(n):
                    body = {"model": "llama", "messages": [{"role": "user", "content": "hi"}],
                            "max_tokens": 5, "stream": True,
                            "stream_options": {"include_usage": True}}  # fmt: skip
                    r = httpx.post(
                        edge.url + "/v1/chat/completions",
                        json=body,
                        headers={"authorization": f"Bearer {key(tenant)}"},
                        timeout=30,
                    )
                    assert r.status_code == 200 and r.text.rstrip().endswith("[DONE]")
            text = httpx.get(edge.ops + "/metrics", timeout=10).text
        finally:
            edge.proc.stop()
    finally:
        engine.proc.stop()
    samples = [s for f in text_string_to_metric_families(text) for s in f.samples]

    def value(name: str, **labels: str) -> float:
        found = [s.value for s in samples if s.name == name and s.labels == labels]
        assert len(found) == 1, (name, labels, json.dumps([s.labels for s in samples][:5]))
        return found[0]

    tenants = {s.labels["tenant"] for s in samples if s.name.startswith("fedinfer_edge_tenant_")}
    assert tenants == {"t00", "t01", "t02", OTHER_TENANTS}
    requests = "fedinfer_edge_tenant_requests_total"
    assert value(requests, tenant="t00", status="200") == 4
    assert value(requests, tenant="t01", status="200") == 3
    assert value(requests, tenant="t02", status="200") == 2
    assert value(requests, tenant=OTHER_TENANTS, status="200") == 9
    tokens = "fedinfer_edge_tenant_tokens_total"
    assert value(tokens, tenant="t00", kind="completion") == 4 * 5
    assert value(tokens, tenant=OTHER_TENANTS, kind="completion") == 9 * 5
    assert value(tokens, tenant="t00", kind="prompt") > 0
    assert value("fedinfer_edge_tenant_ttft_seconds_count", tenant="t01") == 3
    assert value("fedinfer_edge_tenant_ttft_seconds_count", tenant=OTHER_TENANTS) == 9
    # Inter-token latency: the gaps between the relayed chunks of every stream (the engine
    # waits 0.1 s before each of its 5 tokens, so each stream spends >= 0.4 s after byte one).
    gaps = value("fedinfer_edge_inter_token_latency_seconds_count", model="llama")
    assert gaps >= 18  # at least one gap per stream
    assert value("fedinfer_edge_inter_token_latency_seconds_sum", model="llama") >= 18 * 0.3
