"""Usage records are billed only as far as their sender is trusted, on the real PostgreSQL and
Redis: a stream entry counts only with its edge's MAC, every record (stream or HTTP) is checked
alone — its region, the tenant that region may serve, a known model, a time within the window,
values that fit their columns — and a refused one goes to the dead-letter without holding up
its batch, from where an operator can replay it once it is valid."""

from __future__ import annotations

import os
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import redis
from django.utils import timezone
from rest_framework.test import APIClient

from federation.core.models import AuditEvent
from federation.metering.models import UsageDeadLetter, UsageRecord
from federation.metering.stream import GROUP, usage_stream_consume
from federation.routing import services as routing
from federation.tenancy.models import Tenant
from regions.tables.usage import USAGE_FIELD, USAGE_STREAM, encode_record
from regions.tables.usage import UsageRecord as Doc
from tests.integration.inventory_factories import (
    make_deployment,
    make_instance,
    make_model,
    make_pool,
    make_region,
)
from tests.integration.usage_stream_support import STREAM_EDGE, signed, stream_edge

pytestmark = pytest.mark.django_db

EU_EDGE = "edge-eu"
EU_CREDENTIAL = "the-eu-edges-own-credential"


@pytest.fixture
def stream() -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(os.environ["REDIS_URL"])
    client.delete(USAGE_STREAM)
    yield client
    client.delete(USAGE_STREAM)


@pytest.fixture
def fleet() -> str:
    """us-east (US) and eu-west (EU), an edge in each; acme may be served anywhere, euco only
    in the EU."""
    us, eu = make_region("us-east"), make_region("eu-west", "EU")
    model = make_model()
    make_instance(make_deployment(model, make_pool(us, "h100")), "us-1", state="ready")
    stream_edge(us)
    stream_edge(eu, EU_EDGE, EU_CREDENTIAL)
    Tenant.objects.create(slug="acme", name="Acme")
    Tenant.objects.create(slug="euco", name="EU Co", allowed_jurisdictions=["EU"])
    return model.name


def doc(i: int, base: str, tenant: str = "acme", **kw: Any) -> Doc:
    fields: dict[str, Any] = {
        "request_id": f"req-{i}",
        "started_at": (timezone.now() - timedelta(minutes=5, seconds=i)).timestamp(),
        "region": "us-east",
        "entry_region": "us-east",
        "instance": "us-1",
        "model": base,
        "tenant": tenant,
        "key_prefix": "fi_abc",
        "prompt_tokens": 100 + i,
        "cached_tokens": 0,
        "completion_tokens": 20,
        "duration_ms": 900.0,
        "edge": STREAM_EDGE,
        **kw,
    }
    return Doc(**fields)


def lines(*docs: Doc) -> bytes:
    return b"".join(encode_record(d) + b"\n" for d in docs)


def reasons() -> list[str]:
    return sorted(UsageDeadLetter.objects.values_list("reason", flat=True))


def drained(stream: redis.Redis) -> bool:
    return stream.xlen(USAGE_STREAM) == 0 and stream.xpending(USAGE_STREAM, GROUP)["pending"] == 0


def test_a_forged_stream_entry_is_never_billed_and_goes_whole_to_the_dead_letter(
    fleet: str, stream: redis.Redis
) -> None:
    batch = lines(doc(1, fleet))
    stream.xadd(USAGE_STREAM, {USAGE_FIELD: batch})  # no identity at all
    stream.xadd(USAGE_STREAM, signed(batch, credential="not-the-edges-credential"))
    stream.xadd(USAGE_STREAM, signed(batch, name="edge-nobody-registered"))
    # The eu edge's MAC, claiming to be the us edge: verified with the us edge's key, it fails.
    forged = signed(batch, name=STREAM_EDGE, credential=EU_CREDENTIAL)
    stream.xadd(USAGE_STREAM, forged)

    result = usage_stream_consume(stream, consumer="test")

    assert result.records == 0 and UsageRecord.objects.count() == 0
    assert reasons() == ["bad mac"] * 4
    assert not UsageDeadLetter.objects.filter(authenticated=True).exists()
    assert drained(stream)


def test_an_edge_bills_only_its_own_regions_tenants(fleet: str, stream: redis.Redis) -> None:
    """A valid MAC from the eu-west edge carrying records of us-east, and the us-east edge
    billing a tenant whose residency excludes its region: refused, and the rest stored."""
    eu_record = doc(1, fleet, region="eu-west", edge=EU_EDGE)
    eu_signed = signed(lines(doc(2, fleet, edge=EU_EDGE), eu_record), EU_EDGE, EU_CREDENTIAL)
    stream.xadd(USAGE_STREAM, eu_signed)
    stream.xadd(USAGE_STREAM, signed(lines(doc(3, fleet, tenant="euco"), doc(4, fleet))))

    result = usage_stream_consume(stream, consumer="test")

    stored = UsageRecord.objects.values_list("request_id", "tenant", "region")
    assert sorted(stored) == [("req-1", "acme", "eu-west"), ("req-4", "acme", "us-east")]
    assert result.rejected == 2
    assert reasons() == [
        "a record of region 'us-east'",
        "region 'us-east' may not serve tenant 'euco'",
    ]
    assert drained(stream)


def test_one_bad_record_is_refused_alone_and_the_entry_is_acknowledged(
    fleet: str, stream: redis.Redis
) -> None:
    """A time that does not convert, integers over their columns, a NUL, an unknown model or
    tenant, a record from the future or older than the window: each refused with its reason,
    the good records of the same entry (and the next entry) billed."""
    now = timezone.now()
    bad = [
        doc(10, fleet, started_at=1e18),
        doc(11, fleet, prompt_tokens=2**40),
        doc(12, fleet, status=70_000),
        doc(13, fleet, request_id="nul\x00id"),
        doc(14, fleet, model="no-such-model"),
        doc(15, fleet, tenant="no-such-tenant"),
        doc(16, fleet, started_at=(now + timedelta(hours=1)).timestamp()),
        doc(17, fleet, started_at=(now - timedelta(days=8)).timestamp()),
    ]
    good = [doc(i, fleet) for i in range(3)]
    stream.xadd(USAGE_STREAM, signed(lines(good[0], *bad, good[1])))
    stream.xadd(USAGE_STREAM, signed(lines(good[2])))

    result = usage_stream_consume(stream, consumer="test")

    assert sorted(UsageRecord.objects.values_list("request_id", flat=True)) == [
        "req-0",
        "req-1",
        "req-2",
    ]
    assert result.records == 3 and result.rejected == len(bad)
    got = reasons()
    assert len(got) == len(bad)
    for expected in (
        "started_at 1e+18 is not a time",
        "prompt_tokens outside 0..2147483647",
        "status outside 0..32767",
        "request_id longer than 64 characters or with a NUL",
        "unknown model 'no-such-model'",
        "unknown tenant 'no-such-tenant'",
        "is in the future",
        "is older than 7 days",
    ):
        assert any(expected in reason for reason in got), (expected, got)
    assert all(letter.edge == STREAM_EDGE for letter in UsageDeadLetter.objects.all())
    assert drained(stream)
    # Claimed again (a worker killed before its XACK): nothing more stored or dead-lettered.
    stream.xadd(USAGE_STREAM, signed(lines(good[0], *bad, good[1])))
    usage_stream_consume(stream, consumer="test")
    assert UsageRecord.objects.count() == 3 and len(reasons()) == len(bad)


def post(client: APIClient, body: bytes, name: str = STREAM_EDGE) -> Any:
    return client.generic(
        "POST", f"/api/v1/edges/{name}/usage", body, content_type="application/x-ndjson"
    )


@pytest.fixture
def edge_client(fleet: str) -> APIClient:
    from federation.inventory.models import Edge

    credential = routing.edge_credential_rotate(actor=None, edge=Edge.objects.get(name=STREAM_EDGE))
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {credential}")
    return client


def test_the_http_answer_lists_the_refused_records_and_a_bad_time_is_no_500(
    fleet: str, edge_client: APIClient
) -> None:
    backdated = (timezone.now() - timedelta(days=30)).timestamp()
    body = lines(
        doc(1, fleet),
        doc(2, fleet, started_at=1e18),
        doc(3, fleet, started_at=backdated),
        doc(4, fleet, tenant="euco"),
        doc(5, fleet, completion_tokens=2**31),
        doc(6, fleet),
    )
    r = post(edge_client, body)
    assert r.status_code == 200, r.content
    assert r.json()["accepted"] == 2
    assert [(x["index"], x["reason"].split(" ")[0]) for x in r.json()["rejected"]] == [
        (1, "started_at"),
        (2, "started_at"),
        (3, "region"),
        (4, "completion_tokens"),
    ]
    assert "older than 7 days" in r.json()["rejected"][1]["reason"]
    assert sorted(UsageRecord.objects.values_list("request_id", flat=True)) == ["req-1", "req-6"]
    letters = UsageDeadLetter.objects.filter(source="http", edge=STREAM_EDGE, region="us-east")
    assert letters.count() == 4
    # Partitions are made only for the months of admitted records.
    assert {r.started_at.astimezone(UTC).month for r in UsageRecord.objects.all()} <= {
        timezone.now().month,
        (timezone.now() - timedelta(days=7)).month,
    }


def test_an_operator_replays_a_dead_letter_once_it_is_valid(
    fleet: str,
    stream: redis.Redis,
    operator_client: APIClient,
    client_for: Any,
    make_viewer: Any,
) -> None:
    stream.xadd(USAGE_STREAM, signed(lines(doc(1, fleet, tenant="newco"), doc(2, fleet))))
    usage_stream_consume(stream, consumer="test")
    [letter] = UsageDeadLetter.objects.all()
    assert letter.reason == "unknown tenant 'newco'"

    listing = operator_client.get("/api/v1/usage/dead-letters/")
    assert listing.status_code == 200, listing.content
    [row] = listing.json()["results"]
    assert row["id"] == letter.pk and row["source"] == "stream" and '"newco"' in row["document"]
    viewer = client_for(make_viewer(Tenant.objects.get(slug="acme")))
    refused = viewer.get("/api/v1/usage/dead-letters/")
    assert refused.status_code == 403
    assert refused.json() == {
        "detail": "Only admins and operators read and replay usage dead letters."
    }
    replay = f"/api/v1/usage/dead-letters/{letter.pk}/replay/"
    assert viewer.post(replay).status_code == 403

    still = operator_client.post(replay)  # not valid yet: kept, nothing stored
    assert still.status_code == 200 and still.json() == {
        "accepted": 0,
        "refused": ["unknown tenant 'newco'"],
        "removed": False,
    }
    Tenant.objects.create(slug="newco", name="New Co")  # the tenant it was served for
    done = operator_client.post(replay)
    assert done.json() == {"accepted": 1, "refused": [], "removed": True}
    assert operator_client.post(replay).status_code == 404  # replayed once, gone
    assert UsageRecord.objects.filter(tenant="newco").count() == 1
    assert UsageRecord.objects.count() == 2
    assert AuditEvent.objects.filter(action="usage_dead_letter.replay").count() == 2


def test_a_forged_entry_cannot_be_replayed_into_billing(
    fleet: str, stream: redis.Redis, operator_client: APIClient
) -> None:
    stream.xadd(USAGE_STREAM, signed(lines(doc(1, fleet)), credential="guessed"))
    usage_stream_consume(stream, consumer="test")
    [letter] = UsageDeadLetter.objects.all()
    r = operator_client.post(f"/api/v1/usage/dead-letters/{letter.pk}/replay/")
    assert r.json() == {"accepted": 0, "refused": ["bad mac"], "removed": False}
    assert UsageRecord.objects.count() == 0


def test_the_dead_letter_keeps_only_its_newest_rows(
    fleet: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from federation.metering import services

    monkeypatch.setattr(services, "DEAD_LETTER_MAX_ROWS", 3)
    letters = [
        services.DeadLetterIn(
            source="http", edge=STREAM_EDGE, region="us-east", document=b"x%d" % i, reason="r"
        )
        for i in range(5)
    ]
    assert services.usage_dead_letters_add(letters=letters[:2]) == 0
    assert services.usage_dead_letters_add(letters=letters[2:]) == 2
    kept = UsageDeadLetter.objects.order_by("id").values_list("document", flat=True)
    assert [bytes(d) for d in kept] == [b"x2", b"x3", b"x4"]


def test_a_months_statement_is_final_only_once_no_late_record_can_enter_it(
    fleet: str, operator_user: Any
) -> None:
    from tests.integration.inventory_factories import services_clock

    operator = APIClient()
    operator.force_authenticate(operator_user)  # a login that does not depend on the clock

    def final(at: datetime) -> bool:
        with services_clock(at):
            r = operator.get("/api/v1/usage/statement/", {"tenant": "acme", "month": "2026-01"})
        assert r.status_code == 200, r.content
        return bool(r.json()["final"])

    assert not final(datetime(2026, 2, 7, 23, tzinfo=UTC))  # January's records may still come
    assert final(datetime(2026, 2, 8, 0, 1, tzinfo=UTC))


def test_the_console_lists_dead_letters_and_replays_one(
    fleet: str, stream: redis.Redis, operator_user: Any, make_viewer: Any
) -> None:
    from django.test import Client
    from django.urls import reverse

    stream.xadd(USAGE_STREAM, signed(lines(doc(1, fleet, tenant="newco"))))
    usage_stream_consume(stream, consumer="test")
    [letter] = UsageDeadLetter.objects.all()
    operator = Client()
    operator.force_login(operator_user)
    page = operator.get(reverse("console:dead-letters"))
    assert page.status_code == 200
    html = page.content.decode()
    assert "unknown tenant &#x27;newco&#x27;" in html and STREAM_EDGE in html
    assert reverse("console:dead-letters") in html  # the navigation links to it
    assert "<script>" not in html and "onclick" not in html
    viewer = Client()
    viewer.force_login(make_viewer(Tenant.objects.get(slug="acme")))
    replay = reverse("console:dead-letter-replay", args=[letter.pk])
    assert viewer.post(replay).status_code == 403
    assert viewer.get(reverse("console:dead-letters")).status_code == 403

    Tenant.objects.create(slug="newco", name="New Co")
    done = operator.post(replay, follow=True)
    assert "Replayed: 1 record(s) stored." in done.content.decode()
    assert UsageRecord.objects.filter(tenant="newco").count() == 1
    assert not UsageDeadLetter.objects.exists()
    assert operator.post(replay).status_code == 404


def test_an_entry_with_more_records_than_an_edge_ships_is_set_aside_whole(
    fleet: str, stream: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    from federation.metering import stream as ingestion

    monkeypatch.setattr(ingestion, "MAX_ENTRY_RECORDS", 2)
    stream.xadd(USAGE_STREAM, signed(lines(*(doc(i, fleet) for i in range(3)))))
    stream.xadd(USAGE_STREAM, signed(lines(doc(9, fleet))))
    usage_stream_consume(stream, consumer="test")
    assert list(UsageRecord.objects.values_list("request_id", flat=True)) == ["req-9"]
    assert reasons() == ["more than 2 records"]
    assert drained(stream)
