"""The console's fast paths give the same answers as the plain ones, on PostgreSQL: the tenant
rows of the routing snapshot (plain rows) equal the ones built from model instances; a preview
compiled without keys and budget leases equals the one compiled with them; a usage report of
only some sums equals the full report's columns; the usage page's chart and table equal those
of full reports; a routing diff PostgreSQL computes from the stored documents equals the
one computed from the decoded documents."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import astuple, replace
from datetime import UTC, date, datetime, time, timedelta
from decimal import Decimal
from functools import partial
from typing import Any

import orjson
import pytest
from django.core.paginator import Paginator
from django.utils import timezone
from msgspec.structs import replace as replace_struct

from console.charts import MAX_SERIES, chart_series
from console.preview import Move, Preview, preview, snapshot_after
from console.tablediff import SCALARS, SECTIONS, TableDiff, diff_from_changes, table_diff
from console.views import fleet as fleet_views
from console.views.reports import MANY_GROUPS, TOTALS_SHOWN, _totals, _usage_view
from federation.inventory import lifecycle
from federation.inventory.models import Instance, Region
from federation.metering.models import USAGE_SUMS, CountedSpend, UsageDay
from federation.metering.selectors import (
    UsageQuery,
    month_of,
    usage_report,
    usage_report_by_group_and_bucket,
)
from federation.routing import distribution
from federation.routing.compiler import compile_region_table, fleet_plan
from federation.routing.models import RoutingTableVersion
from federation.routing.selectors import (
    budget_rows,
    fleet_snapshot,
    tenant_cache_salt,
    tenant_rows,
)
from federation.routing.services import routing_tables_publish
from federation.routing.snapshot import KeyRow, TenantRow
from federation.tenancy import services as tenancy
from federation.tenancy.models import ApiKey, Tenant
from federation.tenancy.residency import ResidencyPolicy
from federation.tenancy.selectors import api_key_table_entries
from regions.tables.schema import decode_table
from tests.integration.console_support import demo_fleet

pytestmark = pytest.mark.django_db


def _spend(tenant: str, usd: str) -> None:
    CountedSpend.objects.create(
        month=month_of(timezone.now()), tenant=tenant, key_prefix="", edge="", price_usd=usd
    )


@pytest.fixture
def varied_fleet() -> Iterator[None]:
    """The demo fleet with two days of usage, plus tenants of every kind the snapshot reads:
    budgets ok, warned and exhausted, explicit regions, an isolated KV cache, limits, a key in
    its rotation grace, a revoked key, and an inactive tenant."""
    demo_fleet(usage_days=2)
    eu, us = Region.objects.get(code="eu-west"), Region.objects.get(code="us-east")
    kinds: list[dict[str, Any]] = [
        {"slug": "fp-ok", "monthly_budget_usd": Decimal("100.00"), "allowed_jurisdictions": []},
        {"slug": "fp-warn", "monthly_budget_usd": Decimal("10.00"), "allowed_jurisdictions": []},
        {"slug": "fp-out", "monthly_budget_usd": Decimal("1.00"), "allowed_jurisdictions": ["EU"]},
        {"slug": "fp-eu-only", "allowed_jurisdictions": ["EU"], "requests_per_minute": 60},
        {"slug": "fp-salted", "allowed_jurisdictions": ["US"], "isolate_kv_cache": True},
        {"slug": "fp-regions", "allowed_jurisdictions": ["EU", "US"], "tokens_per_minute": 9000},
        {"slug": "fp-gone", "allowed_jurisdictions": []},
    ]
    for kind in kinds:
        tenant = Tenant.objects.create(name=kind["slug"], **kind)
        tenancy.api_key_create(actor=None, tenant=tenant, name="k")
    tenancy.tenant_deactivate(actor=None, tenant=Tenant.objects.get(slug="fp-gone"))
    Tenant.objects.get(slug="fp-regions").allowed_regions.set([eu, us])
    Tenant.objects.get(slug="fp-out").allowed_regions.set([eu])
    _spend("fp-warn", "9.00")
    _spend("fp-out", "1.50")
    _spend("fp-ok", "3.25")
    rotated = ApiKey.objects.get(tenant__slug="fp-ok")
    tenancy.api_key_rotate(actor=None, api_key=rotated, grace_seconds=3600)
    revoked = ApiKey.objects.get(tenant__slug="fp-eu-only")
    tenancy.api_key_revoke(actor=None, api_key=revoked)
    routing_tables_publish()  # tables carrying budget leases, read back by the next snapshot
    yield


def _reference_tenant_rows(now: datetime, spend: dict[str, float]) -> tuple[TenantRow, ...]:
    """The snapshot's tenant rows the plain way: model instances and their related rows."""
    keys: dict[int, list[KeyRow]] = {}
    for entry in api_key_table_entries(now=now):
        keys.setdefault(entry.tenant_id, []).append(
            KeyRow(entry.key_hash, entry.valid_until, entry.scopes)
        )
    tenants = list(Tenant.objects.filter(is_active=True).prefetch_related("allowed_regions"))
    budgets = budget_rows({t.slug: t.monthly_budget_usd for t in tenants}, now=now)
    return tuple(
        TenantRow(
            slug=t.slug,
            policy=ResidencyPolicy.of(
                t.allowed_jurisdictions, [r.code for r in t.allowed_regions.all()]
            ),
            requests_per_minute=t.requests_per_minute,
            tokens_per_minute=t.tokens_per_minute,
            monthly_budget_usd=(
                None if t.monthly_budget_usd is None else float(t.monthly_budget_usd)
            ),
            spend_usd=spend.get(t.slug, 0.0),
            keys=tuple(keys.get(t.pk, ())),
            cache_salt=tenant_cache_salt(t.slug) if t.isolate_kv_cache else None,
            budget=budgets.get(t.slug),
        )
        for t in tenants
    )


def test_tenant_rows_from_plain_rows_equal_those_from_model_instances(varied_fleet: None) -> None:
    now = timezone.now()
    spend = {"fp-warn": 9.0, "fp-out": 1.5, "fp-ok": 3.25}
    rows = tenant_rows(now=now, spend_usd=spend)
    assert rows == _reference_tenant_rows(now, spend)
    by_slug = {r.slug: r for r in rows}
    # The fixture's kinds are all there to compare: not a vacuous equality.
    assert "fp-gone" not in by_slug
    assert len(by_slug["fp-ok"].keys) == 2  # the current secret and the one in its grace
    assert by_slug["fp-eu-only"].keys == ()  # its only key is revoked
    assert by_slug["fp-salted"].cache_salt is not None
    assert by_slug["fp-regions"].policy.regions == {"eu-west", "us-east"}
    assert by_slug["fp-out"].budget is not None and by_slug["fp-out"].budget.published


def test_tenant_rows_are_handed_back_until_something_they_are_built_from_changes(
    varied_fleet: None,
) -> None:
    """The same rows (the same tuple) while nothing changed; after any change to what they
    are built from, new rows equal to those built the plain way."""
    now = timezone.now()
    spend = {"fp-warn": 9.0, "fp-out": 1.5, "fp-ok": 3.25}
    first = tenant_rows(now=now, spend_usd=spend)
    assert tenant_rows(now=now, spend_usd=spend) is first
    lean = tenant_rows(now=now, spend_usd=spend, keys_and_budgets=False)
    assert lean is not first and lean != first
    eu = Region.objects.get(code="eu-west")
    regions = Tenant.objects.get(slug="fp-regions")
    changes: dict[str, Any] = {
        "a limit": lambda: Tenant.objects.filter(slug="fp-ok").update(requests_per_minute=7),
        "a jurisdiction": lambda: Tenant.objects.filter(slug="fp-ok").update(
            allowed_jurisdictions=["US"]
        ),
        "an allowed region": lambda: regions.allowed_regions.set([eu]),
        "an isolated cache": lambda: Tenant.objects.filter(slug="fp-ok").update(
            isolate_kv_cache=True
        ),
        "a new key": lambda: tenancy.api_key_create(
            actor=None, tenant=Tenant.objects.get(slug="fp-warn"), name="k2"
        ),
        "a tenant gone": lambda: Tenant.objects.filter(slug="fp-salted").update(is_active=False),
        "the spend": lambda: spend.update({"fp-ok": 99.0}),
        "the spend counted against a budget": lambda: CountedSpend.objects.filter(
            tenant="fp-ok"
        ).update(price_usd="50.00"),
    }
    previous = tenant_rows(now=now, spend_usd=spend)
    for name, change in changes.items():
        change()
        rows = tenant_rows(now=now, spend_usd=spend)
        assert rows is not previous and rows != previous, name
        assert rows == _reference_tenant_rows(now, spend), name
        previous = rows


def _comparable(result: Preview) -> tuple[Any, ...]:
    """Everything a preview shows. A group's representative policy is compared on what a
    decision reads (its keys and leases are what the lean snapshot leaves out)."""

    def move(m: Move) -> tuple[Any, ...]:
        p = m.group.policy
        rule = (p.tenant, p.allowed_regions, p.residency_class, p.budget_state)
        return (rule, m.group.tenants, m.origin, m.model, astuple(m.before), astuple(m.after))

    return (
        [move(m) for m in result.moves],
        result.leaving,
        result.joining,
        result.serving_usd_per_hour,
        result.demand_usd_per_hour,
        result.unserved_tokens_per_s,
    )


def _actions() -> dict[str, dict[str, Any]]:
    ready_eu = Instance.objects.filter(
        deployment__pool__region__code="eu-west", state=lifecycle.READY
    )
    one = Instance.objects.filter(deployment__pool__region__code="us-east", state="ready").first()
    assert one is not None
    return {
        "evacuate eu-west": {
            "region_status": {"eu-west": Region.Status.EVACUATED},
            "instance_states": {i.name: lifecycle.DRAINING for i in ready_eu},
        },
        "drain one": {"instance_states": {one.name: lifecycle.DRAINING}},
        "restore a region that was evacuated": {
            "region_status": {"eu-west": Region.Status.ACTIVE},
            "restored_at": {"eu-west": timezone.now()},
        },
        "cordon": {},
    }


def test_a_preview_without_keys_and_leases_equals_the_full_one(varied_fleet: None) -> None:
    now = timezone.now()
    full = fleet_snapshot(now=now)
    lean = fleet_snapshot(now=now, keys_and_budgets=False)
    # The full snapshot has what the lean one leaves out; the rest is the same.
    assert any(t.keys for t in full.tenants) and any(t.budget for t in full.tenants)
    assert not any(t.keys or t.budget for t in lean.tenants)
    assert full.prices and not lean.prices
    strip = {"keys": (), "budget": None}
    assert tuple(replace(t, **strip) for t in full.tenants) == lean.tenants
    assert (full.regions, full.instances, full.rtt_ms) == (
        lean.regions,
        lean.instances,
        lean.rtt_ms,
    )
    for name, changes in _actions().items():
        expected = preview(full, snapshot_after(full, **changes))
        got = preview(lean, snapshot_after(lean, **changes))
        assert _comparable(got) == _comparable(expected), name
    evacuation = preview(lean, snapshot_after(lean, **_actions()["evacuate eu-west"]))
    assert evacuation.moves and evacuation.refusals and evacuation.leaving
    # Budget states decide requests: the lean snapshot's tenants carry all three.
    states = {e.tenant: e.budget_state for e in fleet_plan(lean).tenant_entries}
    assert (states["fp-ok"], states["fp-warn"], states["fp-out"]) == ("ok", "warn", "exhausted")


def _documents(snapshot: Any, plan: Any) -> dict[str, dict[str, Any]]:
    return {
        r.code: compile_region_table(snapshot, region=r.code, version=1, generated_at="", plan=plan)
        for r in snapshot.regions
    }


@pytest.mark.parametrize("lean", [False, True])
def test_a_plan_reusing_the_tenants_of_another_equals_a_fresh_one(
    varied_fleet: None, lean: bool
) -> None:
    """The preview compiles the fleet after an action reusing the tenants' part of the plan
    before it; ``fleet_plan`` takes it only when computed from the same inputs, so the tables
    are those of a fresh plan — and budget leases follow an evacuated region's edges."""
    before = fleet_snapshot(now=timezone.now(), keys_and_budgets=not lean)
    plan_b = fleet_plan(before)
    for name, changes in _actions().items():
        after = snapshot_after(before, **changes)
        reused, fresh = fleet_plan(after, reuse=plan_b.tenant_plan), fleet_plan(after)
        assert _documents(after, reused) == _documents(after, fresh), name
        # Taken unless an evacuation moves the leases of budgeted tenants (the full snapshot).
        moved_leases = not lean and name == "evacuate eu-west"
        assert (reused.tenant_plan is plan_b.tenant_plan) is not moved_leases, name
    other = replace(before, tenants=before.tenants[1:], plans={})
    assert fleet_plan(other, reuse=plan_b.tenant_plan).tenant_plan is not plan_b.tenant_plan
    assert _documents(before, plan_b) == _documents(before, fleet_plan(before, reuse=None))


def test_a_preview_after_a_change_is_not_the_last_ones(varied_fleet: None) -> None:
    """The console keeps the last preview's tenant plan for the next: a preview after
    tenants changed equals one computed afresh, not the last."""
    evacuate = _actions()["evacuate eu-west"]
    first = fleet_views._preview(**evacuate)
    assert first.moves and fleet_views._last_preview.tenant_plan is first.tenant_plan
    again = fleet_views._preview(**evacuate)
    assert again.tenant_plan is first.tenant_plan  # nothing changed: reused
    assert _comparable(again) == _comparable(first)
    # fp-eu-only may now be served anywhere: it moves with the others, no longer refused.
    Tenant.objects.filter(slug="fp-eu-only").update(allowed_jurisdictions=[])
    changed = fleet_views._preview(**evacuate)
    snapshot = fleet_snapshot(keys_and_budgets=False)
    fresh = preview(snapshot, snapshot_after(snapshot, **evacuate))
    assert changed.tenant_plan is not first.tenant_plan
    assert _comparable(changed) == _comparable(fresh) != _comparable(first)


def _range(days: int) -> tuple[datetime, datetime]:
    end = datetime.combine(date.today() + timedelta(days=1), time(0), tzinfo=UTC)
    return end - timedelta(days=days), end


@pytest.mark.parametrize("with_cost", [True, False])
@pytest.mark.parametrize(
    ("group_by", "bucket", "hourly"),
    [
        (["tenant"], None, False),
        (["model"], "day", False),
        ([], "day", False),
        (["region"], "hour", True),
    ],
)
def test_a_report_of_some_sums_equals_the_full_reports_columns(
    varied_fleet: None, with_cost: bool, group_by: list[str], bucket: Any, hourly: bool
) -> None:
    start, end = _range(3)
    if hourly:  # not whole days: read from the hourly rollups
        start += timedelta(hours=5)
    query = partial(UsageQuery, start, end, group_by=group_by, bucket=bucket, with_cost=with_cost)
    full = usage_report(query())
    assert full and any(row["requests"] for row in full)
    keys = [*([bucket] if bucket else []), *group_by]
    for only in (["price_usd"], ["requests", "cached_tokens"], ["margin_usd"], ["cost_usd"]):
        if not with_cost and set(only) <= {"margin_usd", "cost_usd"}:
            with pytest.raises(ValueError, match="nothing to sum"):
                usage_report(query(only=only))
            continue
        got = usage_report(query(only=only))
        kept = [c for c in [*keys, *USAGE_SUMS, "margin_usd"] if c in got[0]]
        assert set(kept) - set(keys) <= {*only, "price_usd", "cost_usd"}
        assert got == [{c: row[c] for c in kept} for row in full], only
    with pytest.raises(ValueError, match="no such usage sum"):
        usage_report(query(only=["price"]))


def _many_tenants_usage(days: int) -> None:
    """70 more tenants' daily usage, many of them tied on every figure (ranks must agree)."""
    today = datetime.now(UTC).date()
    UsageDay.objects.bulk_create(
        UsageDay(
            day=today - timedelta(days=d),
            tenant=f"fp-many-{i:02d}",
            model="meta-llama/Llama-3.1-8B-Instruct",
            region=("us-east", "eu-west")[i % 2],
            pool="",
            requests=10 * (i % 4 + 1),
            cancelled=i % 2,
            errors=0,
            prompt_tokens=1_000 * (i % 3 + 1),
            cached_tokens=100 * (i % 5),
            completion_tokens=500 * (i % 4 + 1),
            price_usd=Decimal("0.000123456789") * (i % 6 + 1),
            cost_usd=Decimal("0.0001") * (i % 3 + 1),
        )
        for i in range(70)
        for d in range(days)
    )


@pytest.mark.parametrize(
    ("group", "bucket", "hourly", "only", "with_cost", "filters"),
    [
        ("tenant", "day", False, ["price_usd"], True, {}),
        ("tenant", "day", False, ["margin_usd"], True, {"region": ["us-east"]}),
        ("tenant", "hour", False, ["requests", "cached_tokens"], False, {}),
        ("model", "day", True, [], True, {}),
        ("pool", "day", True, ["prompt_tokens"], False, {"tenant": ["fp-many-03", "acme-us"]}),
    ],
)
def test_one_pass_by_group_and_by_bucket_equals_two_reports(
    varied_fleet: None,
    group: Any,
    bucket: Any,
    hourly: bool,
    only: list[str],
    with_cost: bool,
    filters: dict[Any, list[str]],
) -> None:
    _many_tenants_usage(days=3)
    start, end = _range(3)
    if hourly:  # not whole days: read from the hourly rollups
        start += timedelta(hours=5)
    query = partial(UsageQuery, start, end, only=only, with_cost=with_cost, filters=filters)
    groups, buckets = usage_report_by_group_and_bucket(query(bucket=bucket), group)
    expected_groups = usage_report(query(group_by=[group]))
    expected_buckets = usage_report(query(bucket=bucket))
    assert groups and buckets and len(groups) > 1
    assert groups == expected_groups and buckets == expected_buckets
    # The same types too (an int sum is not handed on as a Decimal, nor the reverse).
    typed = [[(k, type(v)) for k, v in row.items()] for row in groups + buckets]
    assert typed == [
        [(k, type(v)) for k, v in row.items()] for row in expected_groups + expected_buckets
    ]


def _unoptimised_usage_view(
    query: Any, filters: dict[Any, list[str]], data: dict[str, Any], metrics: list[str]
) -> tuple[dict[str, Any], list[dict[str, Any]], int]:
    """The usage page's figures as they were computed before: every sum of every tenant,
    ranked in Python (the code this replaced, kept here as the reference)."""
    group, bucket, metric = data["group_by"], data["bucket"], data["metric"]
    if group not in MANY_GROUPS:
        rows = usage_report(query(group_by=[group], bucket=bucket, filters=filters))
        chart = chart_series(rows, time_key=bucket, group_key=group, metric=metric)
        totals = _totals(rows, group, metrics)
    else:
        totals = [
            {group: r[group] or "—", **{m: r.get(m) or 0 for m in metrics}}
            for r in usage_report(query(group_by=[group], filters=filters))
        ]
        by_size = sorted(totals, key=lambda r: -float(r.get(metric, 0)))
        shown = [r[group] for r in by_size[:MAX_SERIES]]
        chart = chart_series(
            usage_report(query(group_by=[group], bucket=bucket, filters={**filters, group: shown})),
            time_key=bucket,
            group_key=group,
            metric=metric,
            overall=usage_report(query(bucket=bucket, filters=filters)),
            hidden=len(totals) - len(shown),
        )
    totals.sort(key=lambda r: (-float(r.get(metric, 0)), str(r[group])))
    return chart, totals[:TOTALS_SHOWN], len(totals)


@pytest.mark.parametrize(
    ("group", "metric", "staff"),
    [
        ("tenant", "price_usd", True),
        ("tenant", "margin_usd", True),
        ("tenant", "requests", True),
        ("tenant", "cached_tokens", False),
        ("model", "requests", True),
        ("region", "cost_usd", True),
    ],
)
def test_the_usage_pages_chart_and_table_equal_the_unoptimised_ones(
    varied_fleet: None, group: str, metric: str, staff: bool
) -> None:
    _many_tenants_usage(days=3)
    start, end = _range(3)
    metrics = ["requests", "prompt_tokens", "completion_tokens", "price_usd"]
    metrics += ["cost_usd", "margin_usd"] if staff else []
    metrics += [] if metric in metrics else [metric]
    data = {"group_by": group, "bucket": "day", "metric": metric}
    query = partial(UsageQuery, start, end, with_cost=staff)
    fast = _usage_view(query, {}, data, metrics)
    assert fast == _unoptimised_usage_view(query, {}, data, metrics)
    chart, totals, groups = fast
    assert totals and chart["series"] and chart["x"]
    if group == "tenant":  # more tenants than the table lists, ties among them, an "other"
        assert groups > TOTALS_SHOWN == len(totals)
        assert chart["series"][-1]["label"] == f"other ({groups - MAX_SERIES})"
        ranked = [float(r[metric]) for r in totals]
        assert len(set(ranked)) < len(ranked)


def _stored(region: Region, version: int, document: dict[str, Any]) -> RoutingTableVersion:
    return RoutingTableVersion.objects.create(
        region=region, version=version, document=document, body_hash=f"h{version}"
    )


def _odd_documents() -> tuple[dict[str, Any], dict[str, Any]]:
    """Two documents with what a diff must get right beyond the compiler's tables: entries
    added, removed and changed in several sections, equal numbers written differently (1 and
    1.0), objects with their keys in another order, duplicate keys (the last counts), entries
    that are not objects or lack a string key, and a section that is not a list."""
    old = {
        "schema_version": 3,
        "ramp": 1,
        "instances": [
            {"id": "a", "weight": 0.5, "adapters": ["x"]},
            {"id": "b", "weight": 0.5},
            {"id": "dup", "weight": 1},
            {"id": "dup", "weight": 2},
            "not an entry",
            {"weight": 3},
            {"id": 7, "weight": 4},
        ],
        "routes": [{"model": "m", "remotes": [{"code": "r", "weight": 1}]}],
        "remote_regions": {"not": "a list"},
        "tenants": [{"tenant": f"t{i}", "budget_state": "ok", "rps": 1} for i in range(30)],
    }
    new = {
        "schema_version": 4,
        "ramp": 1.0,
        "instances": [
            {"weight": 0.5, "id": "a", "adapters": ["x", "y"]},
            {"id": "c", "weight": 0.0},
            {"id": "dup", "weight": 2.0},
            {"id": 7, "weight": 5},
        ],
        "routes": [{"model": "m", "remotes": [{"weight": 1.0, "code": "r"}]}],
        "remote_regions": [{"code": "eu", "rtt_ms": 80}],
        "tenants": [
            {"tenant": f"t{i}", "budget_state": "warn" if i == 3 else "ok", "rps": 1.0}
            for i in range(1, 31)
        ],
    }
    return old, new


def _sql_diff(old: RoutingTableVersion, new: RoutingTableVersion) -> TableDiff:
    found = distribution.routing_table_changes(old=old, new=new, sections=SECTIONS, scalars=SCALARS)
    assert found is not None  # PostgreSQL
    return diff_from_changes(*found)


def test_a_routing_diff_postgresql_computes_equals_the_diff_of_the_documents(
    varied_fleet: None,
) -> None:
    us = Region.objects.get(code="us-east")
    last = RoutingTableVersion.objects.filter(region=us).order_by("-version").first()
    assert last is not None
    drained = Instance.objects.filter(deployment__pool__region=us, state="ready").first()
    assert drained is not None
    tenancy.tenant_create(actor=None, slug="fp-new", name="fp-new", requests_per_minute=60)
    Instance.objects.filter(pk=drained.pk).update(state=lifecycle.DRAINING)
    routing_tables_publish(regions=["us-east"])
    newest = RoutingTableVersion.objects.filter(region=us).order_by("-version").first()
    assert newest is not None and newest.version > last.version
    odd_old, odd_new = _odd_documents()
    pairs = [
        (last, newest),
        (newest, last),
        (newest, newest),
        (_stored(us, 1_000, odd_old), _stored(us, 1_001, odd_new)),
    ]
    for old, new in pairs:
        assert _sql_diff(old, new) == table_diff(old.document, new.document), (old, new)
    sections = {s.name: s for s in _sql_diff(last, newest).sections}
    assert "fp-new" in sections["tenants"].added and drained.name in sections["instances"].removed
    assert sections["routes"].changed
    odd = _sql_diff(*pairs[3])
    sections = {s.name: s for s in odd.sections}
    assert odd.scalars == [("schema_version", 3, 4)]  # ramp 1 == 1.0
    assert (sections["instances"].added, sections["instances"].removed) == (["c"], ["b"])
    assert [c.key for c in sections["instances"].changed] == ["a"]  # dup: 2 == 2.0
    assert not sections["routes"]
    assert sections["remote_regions"].added == ["eu"]
    assert (sections["tenants"].added, sections["tenants"].removed) == (["t30"], ["t0"])
    assert [c.key for c in sections["tenants"].changed] == ["t3"]


def test_a_table_read_in_parts_by_postgresql_equals_the_decoded_document(
    varied_fleet: None,
) -> None:
    """The routing table page reads the document without its tenants and a page of those,
    the inspector the document with one tenant's entry: all as the whole document has them."""
    for tenant in range(60):
        Tenant.objects.create(slug=f"fp-page-{tenant:02d}", name=f"p{tenant}")
    routing_tables_publish()
    us = Region.objects.get(code="us-east")
    stored = RoutingTableVersion.objects.filter(region=us).order_by("-version").first()
    assert stored is not None
    document = stored.document
    entries = document["tenants"]
    assert len(entries) > 60
    found = distribution.routing_table_without_tenants(region=us)
    assert found is not None
    table, rest, count = found
    assert table.pk == stored.pk and count == len(entries)
    assert rest == {k: v for k, v in document.items() if k != "tenants"}
    first = distribution.routing_table_without_tenants(region=us, version=1)
    assert first is not None and first[0].version == 1
    assert distribution.routing_table_without_tenants(region=us, version=10_000) is None
    for q in ("", "fp-page-", "fp-page-1", "acme", "P", "nobody"):
        lazy = distribution.table_tenants(table, contains=q, total=count)
        assert isinstance(lazy, distribution.TableTenants)  # PostgreSQL's
        plain = [t for t in entries if q in t["tenant"]]
        assert len(lazy) == len(plain), q
        fast, slow = Paginator(lazy, 25), Paginator(plain, 25)
        assert fast.num_pages == slow.num_pages, q
        for number in fast.page_range:
            assert list(fast.page(number)) == list(slow.page(number)), (q, number)
        if plain:
            assert (lazy[0], lazy[len(plain) - 1], lazy[-2:]) == (plain[0], plain[-1], plain[-2:])
    with pytest.raises(IndexError):
        distribution.table_tenants(table, contains="nobody", total=count)[0]
    whole = decode_table(orjson.dumps(document))
    for slug in ("fp-regions", "fp-page-07", "nobody"):
        one = distribution.routing_table_for_tenant(region=us, tenant=slug)
        assert one is not None and one[0].pk == stored.pk
        cut = decode_table(one[1])
        assert cut.tenants == tuple(t for t in whole.tenants or () if t.tenant == slug)
        assert replace_struct(cut, tenants=whole.tenants) == whole
