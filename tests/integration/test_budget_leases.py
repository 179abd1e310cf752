"""Budgets that hold across regions: 50 simultaneous requests from a tenant whose monthly budget
pays for 5, sent to the edges of two regions at once, are charged no more than the budget plus
the documented bound (``docs/adr/0008-budget-leases.md``: what requests in flight spend beyond
the worst case their edge held). Real edges on tables the control plane compiled, simulated
engines, the real Redis usage stream and PostgreSQL."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from decimal import ROUND_FLOOR, Decimal
from pathlib import Path

import httpx
import orjson
import pytest
import redis
from django.utils import timezone

from federation.inventory.models import Edge
from federation.inventory.services import edge_register
from federation.metering.models import UsageDeadLetter
from federation.metering.pricing import Price, request_price
from federation.metering.services import model_price_set
from federation.metering.stream import usage_stream_consume
from federation.routing.compiler import compile_fleet_tables
from federation.routing.selectors import fleet_snapshot
from federation.tenancy.models import Tenant
from federation.tenancy.services import api_key_create
from regions.edge.http.endpoints import CHAT
from regions.edge.http.parse import parse_request
from regions.edge.policy.prefix_index import BYTES_PER_TOKEN
from regions.supervisor import wait_until
from regions.tables.usage import USAGE_STREAM
from tests.integration.inventory_factories import (
    make_deployment,
    make_instance,
    make_model,
    make_pool,
    make_region,
)
from tests.integration.test_edge_support import EdgeProc, engine_sims, start_edge
from tests.integration.usage_stream_support import stream_args, stream_edge

pytestmark = pytest.mark.django_db

REDIS_URL = os.environ["REDIS_URL"]  # this test worker's own (tests/isolation.py)
MODEL = "meta-llama/Llama-3.1-8B-Instruct"
#: $1 per million prompt tokens, $99 per million generated: a request of about 100 prompt
#: tokens and 100 generated costs about a cent.
PRICE = Price(Decimal("1"), Decimal("0.5"), Decimal("99"))
BUDGET = Decimal("0.05")
MAX_TOKENS = 100
PROMPT = "Tell me about the history of budgets and leases. " * 8


@dataclass
class World:
    edges: dict[str, EdgeProc]
    key: str
    versions: dict[str, int]
    tmp: Path


def body(i: int) -> bytes:
    return orjson.dumps(
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": f"{PROMPT} ({i:03d})"}],
            "max_tokens": MAX_TOKENS,
        }
    )


def worst_case(raw: bytes) -> Decimal:
    """What the edge holds for the request: its prompt estimate and max_tokens at the price."""
    req = parse_request(raw, endpoint=CHAT, bytes_per_token=BYTES_PER_TOKEN)
    return request_price(
        PRICE,
        prompt_tokens=req.prompt_tokens,
        cached_tokens=0,
        completion_tokens=req.max_output_tokens,
    )


def publish(world: World) -> None:
    """Compile every region's table from the database and hand each edge its own."""
    docs = compile_fleet_tables(
        fleet_snapshot(),
        versions={c: v + 1 for c, v in world.versions.items()},
        generated_at=timezone.now().isoformat(),
    )
    for code, doc in docs.items():
        world.versions[code] = doc["version"]
        edge = world.edges[code]
        edge.table.write_text(json.dumps(doc))
    for code, edge in world.edges.items():
        version = world.versions[code]
        wait_until(
            lambda edge=edge, version=version: (
                httpx.get(edge.ops + "/healthz").json()["table_version"] == version
            ),
            what=f"{code} on table {version}",
        )


@pytest.fixture
def world(tmp_path: Path) -> Iterator[World]:
    stream = redis.Redis.from_url(REDIS_URL)
    stream.delete(USAGE_STREAM)
    with engine_sims(tmp_path, 2, MODEL) as engines:
        model = make_model(name=MODEL)
        tenant = Tenant.objects.create(slug="acme", name="Acme", monthly_budget_usd=BUDGET)
        for engine, (code, jurisdiction) in zip(
            engines, [("us-east", "US"), ("eu-west", "EU")], strict=True
        ):
            region = make_region(code, jurisdiction)
            tenant.allowed_regions.add(region)
            deployment = make_deployment(model, make_pool(region))
            make_instance(deployment, f"{code}-1", "ready", endpoint_url=engine["url"])
            edge_register(actor=None, region=region, name=f"edge-{code}", url="http://e.invalid:1")
            stream_edge(region, f"edge-{code}")  # its credential signs its stream entries
        # Both edges are alive: budgets are leased to edges with a fresh heartbeat.
        Edge.objects.update(last_heartbeat_at=timezone.now())
        model_price_set(
            actor=None, model=model, price=PRICE, effective_from=datetime(2026, 1, 1, tzinfo=UTC)
        )
        key = api_key_create(actor=None, tenant=tenant, name="k").plaintext
        docs = compile_fleet_tables(
            fleet_snapshot(), versions={"us-east": 1, "eu-west": 1}, generated_at="2026-12-01"
        )
        started: dict[str, EdgeProc] = {}
        try:
            for code, doc in docs.items():
                where = tmp_path / code
                where.mkdir()
                started[code] = start_edge(
                    where,
                    doc,
                    *stream_args(where, f"edge-{code}"),
                    "--usage-spool-dir",
                    str(where / "spool"),
                    "--usage-redis-url",
                    REDIS_URL,
                )
            for edge in started.values():
                wait_until(
                    lambda edge=edge: httpx.get(edge.ops + "/healthz").json()["healthy_instances"],
                    what="the edge's instance healthy",
                )
            yield World(started, key, {c: 1 for c in docs}, tmp_path)
        finally:
            for edge in started.values():
                edge.proc.stop()
            stream.delete(USAGE_STREAM)


async def burst(world: World, start: int, count: int) -> list[tuple[bytes, httpx.Response]]:
    """``count`` requests at once, alternating between the two regions' edges."""
    urls = [e.url + "/v1/chat/completions" for e in world.edges.values()]
    headers = {"Authorization": f"Bearer {world.key}", "Content-Type": "application/json"}
    async with httpx.AsyncClient(timeout=60) as client:

        async def one(i: int) -> tuple[bytes, httpx.Response]:
            raw = body(i)
            return raw, await client.post(urls[i % 2], content=raw, headers=headers)

        return await asyncio.gather(*(one(i) for i in range(start, start + count)))


def spend_and_bound(answers: list[tuple[bytes, httpx.Response]]) -> tuple[Decimal, Decimal, int]:
    """(what the served requests cost, the documented bound on overshoot, how many served)."""
    spent = bound = Decimal(0)
    served = 0
    for raw, resp in answers:
        if resp.status_code != 200:
            assert resp.status_code == 429, resp.text
            assert resp.json()["error"]["code"] == "budget_lease_exhausted"
            assert resp.headers["retry-after"]
            continue
        usage = resp.json()["usage"]
        details = usage.get("prompt_tokens_details") or {}
        price = request_price(
            PRICE,
            prompt_tokens=usage["prompt_tokens"],
            cached_tokens=details.get("cached_tokens") or 0,
            completion_tokens=usage["completion_tokens"],
        )
        spent += price
        bound += max(Decimal(0), price - worst_case(raw))
        served += 1
    return spent, bound, served


def ingest(expected: int) -> None:
    client = redis.Redis.from_url(REDIS_URL)
    stored = {"n": 0}

    def everything_counted() -> bool:
        result = usage_stream_consume(client, consumer="test")
        assert result.rejected == 0, list(UsageDeadLetter.objects.values_list("reason"))
        stored["n"] += result.records
        return stored["n"] >= expected

    wait_until(everything_counted, what=f"{expected} usage records ingested", timeout=30)


def test_fifty_simultaneous_requests_with_budget_for_five_overshoot_by_at_most_the_bound(
    world: World,
) -> None:
    per_request = worst_case(body(0))
    assert 4 * per_request < BUDGET < 6 * per_request  # "a budget for 5"

    first = asyncio.run(burst(world, 0, 50))
    spent, bound, served = spend_and_bound(first)
    assert spent <= BUDGET + bound
    # The first compile grants half the budget, split evenly: a quarter to each edge.
    assert served == 2 * int((BUDGET / 4) // per_request) > 0

    # Its records counted, the control plane leases each edge a slice of what remains.
    ingest(served)
    publish(world)
    second = asyncio.run(burst(world, 50, 50))
    more, more_bound, served_again = spend_and_bound(second)
    assert spent + more <= BUDGET + bound + more_bound
    assert served + served_again <= 5

    # Spend at the budget is refused everywhere as exhausted, not merely leased out.
    ingest(served_again)
    spent_in_cents = (spent + more).quantize(Decimal("0.01"), rounding=ROUND_FLOOR)
    Tenant.objects.filter(slug="acme").update(monthly_budget_usd=spent_in_cents)
    publish(world)
    last = asyncio.run(burst(world, 100, 4))
    assert [r.status_code for _, r in last] == [403] * 4
    assert {r.json()["error"]["code"] for _, r in last} == {"budget_exhausted"}


def test_a_new_month_starts_from_a_fresh_lease(world: World) -> None:
    """Spend counted last month does not count against this month's budget."""
    from federation.metering.models import CountedSpend

    last_month = (timezone.now().replace(day=1) - timedelta(days=1)).date().replace(day=1)
    CountedSpend.objects.create(
        month=last_month, tenant="acme", key_prefix="", edge="edge-us-east", price_usd=BUDGET
    )
    publish(world)
    answers = asyncio.run(burst(world, 0, 2))
    assert [r.status_code for _, r in answers] == [200, 200]
