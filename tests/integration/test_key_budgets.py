"""A key's own monthly budget, through the real path: the control plane compiles the table from
the database, a real edge enforces it, the edge's usage records reach PostgreSQL through the
Redis stream and are counted against the key. The key is stopped at its budget while another
key of the same tenant still serves; a rotation mid-month keeps the month's spend with the key;
the tenant's own budget still applies to every key (``docs/adr/0008-budget-leases.md``)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from decimal import ROUND_FLOOR, Decimal
from pathlib import Path
from typing import Any

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
from federation.tenancy.models import ApiKey, Tenant
from federation.tenancy.services import api_key_create, api_key_rotate, api_key_update
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
REGION = "eu-west"
#: $1 per million prompt tokens, $99 per million generated: a request costs about a cent.
PRICE = Price(Decimal("1"), Decimal("0.5"), Decimal("99"))
KEY_BUDGET = Decimal("0.10")
TENANT_BUDGET = Decimal("10.00")
MAX_TOKENS = 100
PROMPT = "Tell me about the history of budgets and keys. " * 8


@dataclass
class World:
    edge: EdgeProc
    tenant: Tenant
    budgeted: ApiKey
    budgeted_secret: str
    other_secret: str
    version: int = 1
    uncounted: int = 0
    doc: dict[str, Any] = field(default_factory=dict)
    sent: int = 0


def body(i: int) -> bytes:
    return orjson.dumps(
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": f"{PROMPT} ({i:03d})"}],
            "max_tokens": MAX_TOKENS,
        }
    )


def worst_case() -> Decimal:
    req = parse_request(body(0), endpoint=CHAT, bytes_per_token=BYTES_PER_TOKEN)
    return request_price(
        PRICE, prompt_tokens=req.prompt_tokens, cached_tokens=0, completion_tokens=MAX_TOKENS
    )


def publish(world: World) -> None:
    """Compile the region's table from the database and wait until the edge applied it."""
    world.version += 1
    docs = compile_fleet_tables(
        fleet_snapshot(), versions={REGION: world.version}, generated_at=timezone.now().isoformat()
    )
    world.doc = docs[REGION]
    world.edge.table.write_text(json.dumps(world.doc))
    wait_until(
        lambda: httpx.get(world.edge.ops + "/healthz").json()["table_version"] == world.version,
        what=f"the edge on table {world.version}",
    )


def ingest(world: World) -> None:
    """Wait until every served request's record is stored and counted."""
    client = redis.Redis.from_url(REDIS_URL)
    stored = {"n": 0}

    def everything_counted() -> bool:
        result = usage_stream_consume(client, consumer="test")
        assert result.rejected == 0, list(UsageDeadLetter.objects.values_list("reason"))
        stored["n"] += result.records
        return stored["n"] >= world.uncounted

    wait_until(everything_counted, what=f"{world.uncounted} records ingested", timeout=30)
    world.uncounted = 0


def send(world: World, secret: str) -> httpx.Response:
    world.sent += 1
    resp = httpx.post(
        world.edge.url + "/v1/chat/completions",
        content=body(world.sent),
        headers={"Authorization": f"Bearer {secret}", "Content-Type": "application/json"},
        timeout=60,
    )
    if resp.status_code == 200:
        world.uncounted += 1
    return resp


def price_of(resp: httpx.Response) -> Decimal:
    usage = resp.json()["usage"]
    details = usage.get("prompt_tokens_details") or {}
    return request_price(
        PRICE,
        prompt_tokens=usage["prompt_tokens"],
        cached_tokens=details.get("cached_tokens") or 0,
        completion_tokens=usage["completion_tokens"],
    )


def spend(world: World, secret: str, *, served: int, limit: int = 12) -> tuple[Decimal, int]:
    """Send ``secret``'s requests one by one until ``served`` were served or the edge refuses
    after a re-lease: (what they cost, how many were served). A refusal for the lease (429)
    is followed by counting the spend and re-leasing, as the worker does."""
    spent, n, stuck = Decimal(0), 0, False
    for _ in range(limit):
        if n == served:
            break
        resp = send(world, secret)
        if resp.status_code == 200:
            spent, n, stuck = spent + price_of(resp), n + 1, False
            continue
        error = resp.json()["error"]["code"]
        if resp.status_code == 403:
            assert error == "budget_exhausted", resp.text
            break
        assert (resp.status_code, error) == (429, "budget_lease_exhausted"), resp.text
        if stuck:  # re-leased and still no room: what remains cannot take its worst case
            break
        ingest(world)
        publish(world)
        stuck = True
    return spent, n


def key_budget(world: World, prefix: str) -> dict[str, Any]:
    [tenant] = [t for t in world.doc["tenants"] if t["tenant"] == "acme"]
    return dict(tenant["budget"]["keys"][prefix])


@pytest.fixture
def world(tmp_path: Path) -> Iterator[World]:
    stream = redis.Redis.from_url(REDIS_URL)
    stream.delete(USAGE_STREAM)
    with engine_sims(tmp_path, 1, MODEL) as [engine]:
        model = make_model(name=MODEL)
        tenant = Tenant.objects.create(slug="acme", name="Acme", monthly_budget_usd=TENANT_BUDGET)
        region = make_region(REGION, "EU")
        tenant.allowed_regions.add(region)
        make_instance(
            make_deployment(model, make_pool(region)), "i-1", "ready", endpoint_url=engine["url"]
        )
        edge_register(actor=None, region=region, name="edge-1", url="http://e.invalid:1")
        stream_edge(region, "edge-1")  # its credential signs its usage stream entries
        Edge.objects.update(last_heartbeat_at=timezone.now())
        model_price_set(
            actor=None, model=model, price=PRICE, effective_from=datetime(2026, 1, 1, tzinfo=UTC)
        )
        budgeted = api_key_create(
            actor=None, tenant=tenant, name="batch", monthly_budget_usd=KEY_BUDGET
        )
        other = api_key_create(actor=None, tenant=tenant, name="interactive")
        doc = compile_fleet_tables(fleet_snapshot(), versions={REGION: 1}, generated_at="x")[REGION]
        where = tmp_path / "edge"
        where.mkdir()
        edge = start_edge(
            where,
            doc,
            *stream_args(where, "edge-1"),
            "--usage-spool-dir",
            str(where / "spool"),
            "--usage-redis-url",
            REDIS_URL,
        )
        try:
            wait_until(
                lambda: httpx.get(edge.ops + "/healthz").json()["healthy_instances"],
                what="the edge's instance healthy",
            )
            yield World(
                edge, tenant, budgeted.api_key, budgeted.plaintext, other.plaintext, doc=doc
            )
        finally:
            edge.proc.stop()
            stream.delete(USAGE_STREAM)


def test_a_key_is_stopped_at_its_budget_across_a_rotation_while_its_tenant_serves(
    world: World,
) -> None:
    worst = worst_case()
    assert 9 * worst < KEY_BUDGET < 11 * worst  # the key's budget pays for about 10

    # Four requests under the key's first secret (the first lease is half the budget).
    before, served = spend(world, world.budgeted_secret, served=4)
    assert served == 4
    ingest(world)

    # Rotated mid-month: the key keeps its budget and its month's spend under the old prefix;
    # the old secret stops working.
    rotated = api_key_rotate(actor=None, api_key=world.budgeted)
    new_prefix = rotated.api_key.prefix
    publish(world)
    assert set(key_budget(world, new_prefix)["leases"]) == {"edge-1"}
    assert send(world, world.budgeted_secret).status_code == 401

    after, served_after = spend(world, rotated.plaintext, served=12, limit=20)
    # What the first secret spent counts: the new one spent only what it left of the budget.
    assert served_after >= 2
    assert before + after <= KEY_BUDGET
    ingest(world)

    # Warned from 80 % of the key's budget, under its new prefix.
    spent = before + after
    warn_at = (spent / Decimal("0.85")).quantize(Decimal("0.01"))
    assert Decimal("0.8") <= spent / warn_at < 1
    api_key_update(
        actor=None,
        api_key=ApiKey.objects.get(pk=world.budgeted.pk),
        data={"monthly_budget_usd": warn_at},
    )
    publish(world)
    assert key_budget(world, new_prefix)["state"] == "warn"

    # At its budget the key is refused as exhausted ...
    api_key_update(
        actor=None,
        api_key=ApiKey.objects.get(pk=world.budgeted.pk),
        data={"monthly_budget_usd": spent.quantize(Decimal("0.01"), rounding=ROUND_FLOOR)},
    )
    publish(world)
    assert key_budget(world, new_prefix)["state"] == "exhausted"
    refused = send(world, rotated.plaintext)
    assert refused.status_code == 403, refused.text
    assert refused.json()["error"]["code"] == "budget_exhausted"

    # ... while another key of the same tenant still serves.
    served_other, n_other = spend(world, world.other_secret, served=2)
    assert n_other == 2
    ingest(world)

    # The tenant's budget still applies to every key.
    tenant_spent = spent + served_other
    Tenant.objects.filter(pk=world.tenant.pk).update(
        monthly_budget_usd=tenant_spent.quantize(Decimal("0.01"), rounding=ROUND_FLOOR)
    )
    publish(world)
    refused = send(world, world.other_secret)
    assert refused.status_code == 403, refused.text
    assert refused.json()["error"]["code"] == "budget_exhausted"


def test_both_secrets_of_a_key_in_rotation_grace_spend_from_its_one_budget(world: World) -> None:
    """During a rotation's grace the old and the new secret are both served, each under its
    own prefix, and together spend no more than the key's budget."""
    rotated = api_key_rotate(actor=None, api_key=world.budgeted, grace_seconds=600)
    publish(world)
    prefixes = {world.budgeted.prefix, rotated.api_key.prefix}
    assert prefixes <= set(world.doc["tenants"][0]["budget"]["keys"])
    spent, served = Decimal(0), {}
    for secret in [rotated.plaintext, world.budgeted_secret] * 6:
        more, n = spend(world, secret, served=1)
        spent += more
        served[secret] = served.get(secret, 0) + n
    assert served[rotated.plaintext] >= 2 and served[world.budgeted_secret] >= 2
    assert spent <= KEY_BUDGET
