"""Usage metering through a real edge, a simulated vLLM engine, Redis and PostgreSQL: every
request's tokens as the client saw them — streamed or not, with or without the client asking
for usage, cached prompts, a client that leaves mid-stream — arrive in the control plane once,
priced to the last digit."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import redis

from federation.metering.models import UsageRecord
from federation.metering.pricing import Price
from federation.metering.services import model_price_set
from federation.metering.stream import usage_stream_consume
from federation.tenancy.models import Tenant
from regions.supervisor import wait_until
from regions.tables.usage import USAGE_FIELD, USAGE_STREAM, decode_record
from tests.integration.inventory_factories import (
    make_deployment,
    make_instance,
    make_model,
    make_pool,
    make_region,
)
from tests.integration.test_edge_support import EdgeProc, engine_sims, start_edge, table_doc
from tests.integration.usage_stream_support import stream_args, stream_edge

REDIS_URL = os.environ["REDIS_URL"]  # this test worker's own (tests/isolation.py)
KEY = "fi_AbCdEf12_" + "s" * 43
MODEL = "meta-llama/Llama-3.1-8B-Instruct"
PRICE = Price(Decimal("0.15"), Decimal("0.075"), Decimal("0.60"))


@pytest.fixture
def stream() -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(REDIS_URL)
    client.delete(USAGE_STREAM)
    yield client
    client.delete(USAGE_STREAM)


@pytest.fixture
def edge(tmp_path: Path, stream: redis.Redis) -> Iterator[EdgeProc]:
    with engine_sims(tmp_path, 1, MODEL) as engines:
        inst = {
            "id": "us-1",
            "url": engines[0]["url"],
            "model": MODEL,
            "max_concurrency": 16,
            "prefill_tokens_per_s": 8000,
        }
        doc = table_doc("us-east", 1, [inst])
        doc["tenants"] = [
            {
                "tenant": "acme",
                "key_hashes": [hashlib.sha256(KEY.encode()).hexdigest()],
                "allowed_regions": ["us-east"],
            }
        ]
        spool = tmp_path / "spool"
        proc = start_edge(
            tmp_path,
            doc,
            *stream_args(tmp_path),
            "--usage-spool-dir",
            str(spool),
            "--usage-redis-url",
            REDIS_URL,
        )
        try:
            yield proc
        finally:
            proc.proc.stop()


def chat(edge: EdgeProc, prompt: str, **kw: Any) -> httpx.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], **kw}
    return httpx.post(
        edge.url + "/v1/chat/completions",
        json=body,
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=60,
    )


def stream_chat(
    edge: EdgeProc, prompt: str, *, stop_after: int | None = None, **kw: Any
) -> tuple[list[dict[str, Any]], bool]:
    """The stream's JSON events (and whether ``[DONE]`` came); ``stop_after``: leave after
    that many events."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "stream": True, **kw}
    events: list[dict[str, Any]] = []
    with httpx.stream(
        "POST",
        edge.url + "/v1/chat/completions",
        json=body,
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=60,
    ) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line == "data: [DONE]":
                return events, True
            if line.startswith("data: "):
                events.append(orjson.loads(line[6:]))
                if stop_after is not None and len(events) >= stop_after:
                    return events, False
    return events, False


def records(client: redis.Redis, n: int) -> list[Any]:
    def stored() -> list[Any]:
        entries = client.xrange(USAGE_STREAM)
        return [decode_record(r) for _, f in entries for r in f[USAGE_FIELD].splitlines()]

    wait_until(lambda: len(stored()) >= n, what=f"{n} usage records", timeout=20)
    return stored()


def test_every_request_is_metered_with_the_tokens_the_client_saw(
    edge: EdgeProc, stream: redis.Redis
) -> None:
    prompt = "Summarise the history of the transistor in three sentences. " * 8
    plain = chat(edge, prompt, max_tokens=24).json()["usage"]
    again = chat(edge, prompt, max_tokens=24).json()["usage"]  # the prompt is cached now
    asked, done = stream_chat(
        edge, "stream with usage", max_tokens=30, stream_options={"include_usage": True}
    )
    assert done and asked[-1]["choices"] == []
    unasked, done = stream_chat(edge, "stream without usage", max_tokens=30)
    assert done and all("usage" not in e or e["usage"] is None for e in unasked)
    _, done = stream_chat(edge, "a long answer, abandoned", max_tokens=400, stop_after=5)
    assert not done

    all_records = records(stream, 5)
    assert len({r.request_id for r in all_records}) == 5
    for r in all_records:
        assert (r.tenant, r.key_prefix, r.region, r.entry_region) == (
            "acme",
            "fi_AbCdEf12",
            "us-east",
            "us-east",
        )
        assert (r.instance, r.model, r.adapter) == ("us-1", MODEL, None)
    first, second = (r for r in all_records if not r.streamed)
    assert (first.prompt_tokens, first.cached_tokens, first.completion_tokens) == (
        plain["prompt_tokens"],
        plain["prompt_tokens_details"]["cached_tokens"],
        plain["completion_tokens"],
    )
    assert second.cached_tokens == again["prompt_tokens_details"]["cached_tokens"] > 0
    asked_usage = asked[-1]["usage"]
    [with_usage, without_usage, cancelled] = [r for r in all_records if r.streamed]
    assert with_usage.completion_tokens == asked_usage["completion_tokens"]
    assert with_usage.prompt_tokens == asked_usage["prompt_tokens"]
    # Without asking, the client got no usage chunk, but the edge asked the engine for it.
    content = [e for e in unasked if e["choices"] and e["choices"][0]["delta"].get("content")]
    assert without_usage.usage_reported and without_usage.completion_tokens == len(content) == 30
    # The client left after 5 events: charged what was relayed, not the 400 it asked for.
    assert cancelled.cancelled and not cancelled.usage_reported and cancelled.status == 499
    assert 4 <= cancelled.completion_tokens < 400


@pytest.mark.django_db
def test_the_control_plane_prices_exactly_what_the_edge_metered(
    edge: EdgeProc, stream: redis.Redis
) -> None:
    region = make_region("us-east")
    model = make_model()
    make_instance(make_deployment(model, make_pool(region)), "us-1", state="ready")
    stream_edge(region)  # the edge's entries are ingested as this registered edge's
    Tenant.objects.create(slug="acme", name="Acme")
    model_price_set(
        actor=None, model=model, price=PRICE, effective_from=datetime.now(UTC) - timedelta(days=1)
    )
    answers = [chat(edge, f"question {i} " * (i + 1), max_tokens=10 + i).json() for i in range(6)]
    streamed, _ = stream_chat(
        edge, "streamed", max_tokens=12, stream_options={"include_usage": True}
    )
    usages = [a["usage"] for a in answers] + [streamed[-1]["usage"]]
    records(stream, 7)
    assert usage_stream_consume(stream, consumer="test").records == 7
    expected = sum(
        (
            (u["prompt_tokens"] - u["prompt_tokens_details"]["cached_tokens"])
            * PRICE.input_per_mtok
            + u["prompt_tokens_details"]["cached_tokens"] * PRICE.cached_input_per_mtok
            + u["completion_tokens"] * PRICE.output_per_mtok
            for u in usages
        ),
        start=Decimal(0),
    ) / Decimal(1_000_000)
    rows = UsageRecord.objects.filter(tenant="acme")
    assert rows.count() == 7
    assert sum((r.price_usd for r in rows), start=Decimal(0)) == expected
    assert sum(r.completion_tokens for r in rows) == sum(u["completion_tokens"] for u in usages)
    assert {r.pool for r in rows} == {"us-east/h100"}
