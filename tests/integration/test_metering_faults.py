"""Usage stays exact through faults: Redis stopped and restarted while the edge serves, an
edge restarted, a worker killed between reading a batch and acknowledging it. Every request
served is stored once — no record lost, none counted twice — and the tokens stored are the
tokens the clients were answered with.

The Redis here is the test's own (a free port, append-only file on, as the usage stream's Redis
must be: docs/metering.md), so stopping it disturbs nothing else.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from federation.metering.models import UsageRecord
from federation.metering.stream import GROUP, usage_stream_consume
from federation.tenancy.models import Tenant
from regions.supervisor import wait_until
from regions.tables.usage import USAGE_STREAM, decode_record
from tests.integration.inventory_factories import (
    make_deployment,
    make_instance,
    make_model,
    make_pool,
    make_region,
)
from tests.integration.redis_support import PrivateRedis, private_redis  # noqa: F401
from tests.integration.test_edge_support import EdgeProc, engine_sims, start_edge, table_doc
from tests.integration.usage_stream_support import stream_args, stream_edge

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
KEY = "fi_FaUlTs01_" + "k" * 43


def edge_with_metering(tmp: Path, engine_url: str, redis_url: str, *args: str) -> EdgeProc:
    inst = {"id": "us-1", "url": engine_url, "model": MODEL, "max_concurrency": 32,
            "prefill_tokens_per_s": 8000}  # fmt: skip
    doc = table_doc("us-east", 1, [inst])
    doc["tenants"] = [
        {
            "tenant": "acme",
            "key_hashes": [hashlib.sha256(KEY.encode()).hexdigest()],
            "allowed_regions": ["us-east"],
        }
    ]
    spool = tmp / "spool"  # the same spool across restarts
    return start_edge(
        tmp,
        doc,
        *stream_args(tmp),
        "--usage-spool-dir",
        str(spool),
        "--usage-redis-url",
        redis_url,
        *args,
    )


def post(edge: EdgeProc, i: int) -> httpx.Response:
    return httpx.post(
        edge.url + "/v1/chat/completions",
        json={
            "model": MODEL,
            "messages": [{"role": "user", "content": f"request {i} " * (1 + i % 7)}],
            "max_tokens": 5 + i % 11,
        },
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=30,
    )


def ask(edge: EdgeProc, i: int) -> dict[str, Any]:
    r = post(edge, i)
    assert r.status_code == 200, r.text
    usage: dict[str, Any] = r.json()["usage"]
    return usage


def metric(edge: EdgeProc, name: str) -> float:
    text = httpx.get(edge.ops + "/metrics", timeout=5).text
    lines = [ln for ln in text.splitlines() if ln.startswith(name + " ")]
    return float(lines[0].split()[-1]) if lines else 0.0


def shipped(edge: EdgeProc) -> float:
    return metric(edge, "fedinfer_edge_usage_shipped_total")


#: A spool this small is full after a few records (~170-230 bytes each).
SMALL_SPOOL = ("--usage-spool-max-bytes", "1000", "--usage-flush-interval", "0.05")


def spooled(edge: EdgeProc, before: float) -> float:
    """Wait until the last request's record is on disk or dropped; the bytes unshipped."""
    wait_until(
        lambda: (
            metric(edge, "fedinfer_edge_usage_unshipped_bytes") > before
            or metric(edge, "fedinfer_edge_usage_dropped_total") > 0
        ),
        what="the record written",
    )
    return metric(edge, "fedinfer_edge_usage_unshipped_bytes")


def test_a_full_spool_refuses_new_requests_until_redis_takes_the_backlog(
    tmp_path: Path,
) -> None:
    away = PrivateRedis(tmp_path)  # not started: Redis is down from the edge's start
    with engine_sims(tmp_path, 1, MODEL, "--zero-latency") as engines:
        edge = edge_with_metering(tmp_path, engines[0]["url"], away.url, *SMALL_SPOOL)
        try:
            served, on_disk = 0, [0.0]
            for i in range(20):
                r = post(edge, i)
                if r.status_code != 200:
                    break
                served += 1
                on_disk.append(spooled(edge, on_disk[-1]))
            assert r.status_code == 503 and r.json()["error"]["code"] == "usage_spool_full"
            # Each record was written before the next request: refused from the one that filled it.
            assert on_disk[-2] < 1000 <= on_disk[-1] and served >= 4
            assert metric(edge, "fedinfer_edge_usage_spool_full") == 1
            away.start()  # Redis back: the backlog goes, the edge serves again
            wait_until(lambda: shipped(edge) == served, what="the backlog shipped", timeout=20)
            assert metric(edge, "fedinfer_edge_usage_spool_full") == 0
            ask(edge, 99)
            wait_until(lambda: shipped(edge) == served + 1, what="the next record shipped")
            stored = redis.Redis.from_url(away.url).xrange(USAGE_STREAM)
            lines = [line for _, f in stored for line in f[b"r"].splitlines()]
            assert len({decode_record(line).request_id for line in lines}) == len(lines)
            assert len(lines) == served + 1  # every record once, the refused request none
        finally:
            edge.proc.stop()
            if away.proc is not None:
                away.stop()


def test_a_full_spool_under_the_serve_policy_serves_and_counts_what_it_drops(
    tmp_path: Path,
) -> None:
    away = PrivateRedis(tmp_path)
    with engine_sims(tmp_path, 1, MODEL, "--zero-latency") as engines:
        args = (*SMALL_SPOOL, "--usage-spool-full", "serve")
        edge = edge_with_metering(tmp_path, engines[0]["url"], away.url, *args)
        try:
            on_disk = 0.0
            for i in range(8):
                ask(edge, i)  # served, full or not
                on_disk = spooled(edge, on_disk)

            def counted() -> tuple[float, float]:
                recorded = metric(edge, "fedinfer_edge_usage_records_total")
                return recorded, metric(edge, "fedinfer_edge_usage_dropped_total")

            wait_until(lambda: sum(counted()) == 8, what="eight records spooled or dropped")
            assert 4 <= counted()[0] < 8 and on_disk >= 1000
            assert metric(edge, "fedinfer_edge_usage_spool_full") == 1
        finally:
            edge.proc.stop()


@pytest.mark.django_db
def test_usage_is_exact_through_redis_edge_and_worker_faults(
    tmp_path: Path,
    private_redis: PrivateRedis,  # noqa: F811
) -> None:
    region = make_region("us-east")
    make_instance(make_deployment(make_model(), make_pool(region)), "us-1", "ready")
    stream_edge(region)  # the edge's entries are ingested as this registered edge's
    Tenant.objects.create(slug="acme", name="Acme")
    client = redis.Redis.from_url(private_redis.url)
    answers: list[dict[str, Any]] = []
    with engine_sims(tmp_path, 1, MODEL, "--zero-latency") as engines:
        edge = edge_with_metering(tmp_path, engines[0]["url"], private_redis.url)
        answers += [ask(edge, i) for i in range(20)]
        wait_until(lambda: shipped(edge) >= 20, what="the first 20 records shipped")

        # Redis goes away: the edge keeps serving, its spool grows, nothing is lost.
        private_redis.stop()
        answers += [ask(edge, i) for i in range(20, 45)]
        # The edge restarts while Redis is still away: its spool is on disk.
        edge.proc.stop()
        earlier = 20  # what the first edge process shipped before Redis went away
        edge = edge_with_metering(tmp_path, engines[0]["url"], private_redis.url)
        answers += [ask(edge, i) for i in range(45, 60)]
        private_redis.start()
        wait_until(lambda: shipped(edge) + earlier >= 60, timeout=30, what="all 60 records")
        edge.proc.stop()

    # A worker reads a batch and dies before it commits: the batch stays pending.
    client.xgroup_create(USAGE_STREAM, GROUP, id="0", mkstream=True)
    client.xreadgroup(GROUP, "killed-worker", {USAGE_STREAM: ">"}, count=25)
    usage_stream_consume(client, consumer="worker-2", batch=10)
    # ...and a batch ingested twice (a worker killed after its commit, before its XACK).
    entries = client.xrange(USAGE_STREAM, count=5)
    for _, fields in entries:
        client.xadd(USAGE_STREAM, fields)
    usage_stream_consume(client, consumer="worker-2", batch=10)
    usage_stream_consume(client, consumer="worker-3", batch=10, claim_idle_ms=0)

    rows = UsageRecord.objects.filter(tenant="acme")
    assert rows.count() == len(answers) == 60
    assert client.xlen(USAGE_STREAM) == 0
    assert client.xpending(USAGE_STREAM, GROUP)["pending"] == 0
    for field in ("prompt_tokens", "completion_tokens"):
        assert sum(getattr(r, field) for r in rows) == sum(a[field] for a in answers)
    assert all(r.usage_reported and r.key_prefix == "fi_FaUlTs01" for r in rows)
