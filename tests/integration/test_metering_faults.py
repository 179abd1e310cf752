"""Usage stays exact through faults: Redis stopped and restarted while the edge serves, an
edge restarted, a worker killed between reading a batch and acknowledging it. Every request
served is stored once — no record lost, none counted twice — and the tokens stored are the
tokens the clients were answered with.

The Redis here is the test's own (a free port, append-only file on, as the usage stream's Redis
must be: docs/metering.md), so stopping it disturbs nothing else.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from federation.metering.models import UsageRecord
from federation.metering.stream import GROUP, usage_stream_consume
from regions.supervisor import Process, free_port, start_process, wait_until
from regions.tables.usage import USAGE_STREAM
from tests.integration.inventory_factories import (
    make_deployment,
    make_instance,
    make_model,
    make_pool,
    make_region,
)
from tests.integration.test_edge_support import EdgeProc, engine_sims, start_edge, table_doc

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
KEY = "fi_FaUlTs01_" + "k" * 43


class PrivateRedis:
    def __init__(self, tmp: Path) -> None:
        self.port = free_port()
        self.dir = tmp / "redis"
        self.dir.mkdir()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: Process | None = None

    def start(self) -> None:
        argv = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1"]
        argv += ["--dir", str(self.dir), "--appendonly", "yes", "--appendfsync", "always"]
        argv += ["--save", ""]
        self.proc = start_process("redis", argv, log=self.dir / "redis.log", append=True)
        client = redis.Redis.from_url(self.url)
        wait_until(lambda: _pings(client), what="the test's Redis", watch=self.proc)

    def stop(self) -> None:
        assert self.proc is not None
        self.proc.stop()


def _pings(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.ConnectionError:
        return False


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[PrivateRedis]:
    server = PrivateRedis(tmp_path)
    server.start()
    yield server
    server.stop()


def edge_with_metering(tmp: Path, engine_url: str, redis_url: str) -> EdgeProc:
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
    return start_edge(tmp, doc, "--usage-spool-dir", str(spool), "--usage-redis-url", redis_url)


def ask(edge: EdgeProc, i: int) -> dict[str, Any]:
    r = httpx.post(
        edge.url + "/v1/chat/completions",
        json={
            "model": MODEL,
            "messages": [{"role": "user", "content": f"request {i} " * (1 + i % 7)}],
            "max_tokens": 5 + i % 11,
        },
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=30,
    )
    assert r.status_code == 200, r.text
    usage: dict[str, Any] = r.json()["usage"]
    return usage


def shipped(edge: EdgeProc) -> float:
    text = httpx.get(edge.ops + "/metrics", timeout=5).text
    lines = [ln for ln in text.splitlines() if ln.startswith("fedinfer_edge_usage_shipped_total")]
    return float(lines[0].split()[-1]) if lines else 0.0


@pytest.mark.django_db
def test_usage_is_exact_through_redis_edge_and_worker_faults(
    tmp_path: Path, private_redis: PrivateRedis
) -> None:
    make_instance(make_deployment(make_model(), make_pool(make_region("us-east"))), "us-1", "ready")
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
