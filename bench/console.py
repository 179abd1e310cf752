"""The console's page times on the real PostgreSQL (`python -m bench console`).

The demo fleet (``loaddemo``, one ready instance per deployment, an edge per region, tables
published) with a month of the demo's generated usage ingested and rolled up, plus
``--tenants`` more tenants (default 5,000), each with an API key and a month of daily usage
rows, so that tenant lists, spend, routing tables and reports carry that many. Then each page
is requested ``--runs`` times (after two warm-ups) through Django's full request stack as an
admin, in process (no network), and its median and p95 are reported. Target: p95 ≤ 300 ms.

The extra tenants, keys and daily rows are bulk-inserted (the services' audit trail for 5,000
tenants is not what is measured); everything else goes through the services. The database is
then analysed, as autovacuum would have done over the month. The bench uses its
own database ``<name of --database-url>_fedbench`` (dropped and created). JSON under
``var/bench/``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from io import StringIO
from typing import Any

from bench.harness.control_plane import bench_database, setup_django
from bench.harness.procs import git_rev, machine_info
from bench.harness.report import fmt, markdown_table, utc_now, write_result

TARGET_MS = 300.0


def build(tenants: int, days: int) -> None:
    """The demo fleet with a month of usage and ``tenants`` more tenants: what a busy console
    shows."""
    from django.core.management import call_command
    from django.db import connection
    from django.utils import timezone

    from federation.demo.usage import load_usage_history
    from federation.inventory import services as inventory
    from federation.inventory.models import Deployment, Region
    from federation.routing.services import routing_tables_publish

    call_command("loaddemo", stdout=StringIO())
    for region in Region.objects.all():
        inventory.edge_register(
            actor=None, region=region, name=f"edge-{region.code}", url=f"http://{region.code}:8100"
        )
    for i, dep in enumerate(Deployment.objects.select_related("pool__region").order_by("pk")):
        name = f"{dep.pool.region.code}-{dep.pool.name}-{i}"
        inst = inventory.instance_create(
            actor=None, deployment=dep, name=name, endpoint_url=f"http://{name}:8000"
        )
        inventory.instance_bring_up(actor=None, instance=inst)
    records = load_usage_history(days=days, now=timezone.now())
    add_tenants(tenants, days)
    routing_tables_publish()
    second_version()
    # A month of rows in a live database has planner statistics (autovacuum's ANALYZE); rows
    # bulk-inserted a moment ago do not, and PostgreSQL would plan as if the tables were empty.
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE")
    print(f"fleet: {records:,} demo requests over {days} days, {tenants:,} more tenants")


def second_version() -> None:
    """Every table again after an ordinary change — a tenant signed up, another's rate limit
    raised — so that the routing diff compares two versions that differ by a few entries."""
    from federation.routing.services import routing_tables_publish
    from federation.tenancy import services as tenancy
    from federation.tenancy.models import Tenant

    tenancy.tenant_create(actor=None, slug="newcomer", name="Newcomer", requests_per_minute=600)
    raised = Tenant.objects.get(slug="t00042")
    tenancy.tenant_update(actor=None, tenant=raised, data={"requests_per_minute": 1_200})
    routing_tables_publish()


def add_tenants(n: int, days: int) -> None:
    """Bulk-insert tenants, keys and daily usage: their audit trail is not what is measured."""
    from django.utils import timezone

    from federation.metering.models import UsageDay
    from federation.tenancy.keys import generate_key
    from federation.tenancy.models import ApiKey, Tenant

    Tenant.objects.bulk_create(
        [
            Tenant(
                slug=f"t{i:05d}",
                name=f"Tenant {i}",
                allowed_jurisdictions=[["US"], ["EU"], []][i % 3],
            )
            for i in range(n)
        ],
        batch_size=2_000,
    )
    keys = []
    for tenant in Tenant.objects.filter(slug__startswith="t0"):
        generated = generate_key()
        keys.append(
            ApiKey(
                tenant=tenant,
                name="default",
                prefix=generated.prefix,
                key_hash=generated.key_hash,
                scopes=["inference"],
            )
        )
    ApiKey.objects.bulk_create(keys, batch_size=2_000)
    today = timezone.now().astimezone(UTC).date()
    regions = ("us-east", "eu-west", "ap-southeast")
    rows = [
        UsageDay(
            day=today - timedelta(days=d),
            tenant=f"t{i:05d}",
            model="meta-llama/Llama-3.1-8B-Instruct",
            region=regions[i % 3],
            pool="",
            requests=100,
            cancelled=0,
            errors=1,
            prompt_tokens=80_000,
            cached_tokens=20_000,
            completion_tokens=15_000,
            price_usd=Decimal("0.021"),
            cost_usd=Decimal("0.013"),
        )
        for i in range(n)
        for d in range(days)
    ]
    UsageDay.objects.bulk_create(rows, batch_size=5_000)


def pages() -> dict[str, str]:
    """Every console page by name, with arguments that hit real rows."""
    from django.urls import reverse

    from federation.tenancy.models import ApiKey

    key = ApiKey.objects.filter(tenant__slug="acme-us").first()
    assert key is not None
    llama = "meta-llama/Llama-3.1-8B-Instruct"
    return {
        "overview": reverse("console:overview"),
        "regions": reverse("console:regions"),
        "region": reverse("console:region", args=["us-east"]),
        "evacuate: confirmation": reverse("console:region-evacuate", args=["eu-west"]),
        "evacuate: its preview (htmx)": reverse("console:region-evacuate", args=["eu-west"])
        + "?preview=1",
        "models": reverse("console:models"),
        "routing": reverse("console:routing"),
        "routing table": reverse("console:routing-table", args=["us-east"]),
        "routing diff": reverse("console:routing-diff", args=["us-east"]),
        "inspector": reverse("console:inspect")
        + f"?tenant=t00042&model={llama}&origin=us-east&session=s1",
        "tenants": reverse("console:tenants"),
        "tenants, page 50": reverse("console:tenants") + "?page=50",
        "tenant": reverse("console:tenant", args=["acme-us"]),
        "key rotate form": reverse("console:key-rotate", args=[key.pk]),
        "usage, month by day": reverse("console:usage"),
        "usage by tenant": reverse("console:usage") + "?group_by=tenant&bucket=day"
        f"&start={(datetime.now(UTC) - timedelta(days=29)).date()}"
        f"&end={datetime.now(UTC).date()}&metric=price_usd",
        "costs": reverse("console:costs"),
        "audit": reverse("console:audit"),
    }


def measure(runs: int) -> dict[str, dict[str, float]]:
    """Each page's median and p95 through Django's full request stack, after two warm-ups."""
    from django.contrib.auth.models import User
    from django.test import Client

    client = Client()
    client.force_login(User.objects.get(username="admin"))
    results: dict[str, dict[str, float]] = {}
    for name, url in pages().items():
        for _ in range(2):
            assert client.get(url).status_code == 200, url
        times = []
        for _ in range(runs):
            t = time.perf_counter()
            response = client.get(url)
            times.append((time.perf_counter() - t) * 1000)
            assert response.status_code == 200, url
        times.sort()
        results[name] = {
            "median_ms": statistics.median(times),
            "p95_ms": times[max(0, round(0.95 * len(times)) - 1)],
            "bytes": len(response.content),
        }
    return results


def main(argv: list[str]) -> None:
    """Load the database, time every page; print and write the result."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--database-url",
        default=os.environ.get("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/fedinfer"),
    )
    parser.add_argument("--tenants", type=int, default=5_000)
    parser.add_argument("--days", type=int, default=30)
    parser.add_argument("--runs", type=int, default=20)
    args = parser.parse_args(argv)
    os.environ.setdefault("FEDINFER_DEBUG", "false")
    setup_django(bench_database(args.database_url))
    build(args.tenants, args.days)
    pages_ms = measure(args.runs)
    result: dict[str, Any] = {
        "bench": "console",
        "when": utc_now(),
        "rev": git_rev(),
        "machine": machine_info(),
        "tenants": args.tenants,
        "days": args.days,
        "runs": args.runs,
        "pages": pages_ms,
    }
    path = write_result("console", result)
    print(
        markdown_table(
            ["page", "median ms", "p95 ms", "KiB", "target"],
            [
                [name, fmt(r["median_ms"], 1), fmt(r["p95_ms"], 1), fmt(r["bytes"] / 1024, 0),
                 "ok" if r["p95_ms"] <= TARGET_MS else f"> {TARGET_MS:.0f}"]
                for name, r in pages_ms.items()
            ],
        )
    )  # fmt: skip
    print(f"\nraw: {path}")
