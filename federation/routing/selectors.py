"""Load the fleet snapshot the pure compiler works on, in a fixed number of queries."""

from __future__ import annotations

import base64
import operator
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from decimal import Decimal
from functools import reduce
from typing import Any

import msgspec
import orjson
from django.conf import settings
from django.db import connection
from django.db.models import Max, Q, QuerySet, TextField
from django.db.models.expressions import RawSQL
from django.db.models.functions import Cast
from django.utils import timezone
from django.utils.crypto import salted_hmac

from federation.inventory import lifecycle
from federation.inventory.models import (
    Deployment,
    Edge,
    GPUPool,
    Instance,
    InstanceInterval,
    LoraAdapter,
    Region,
    RegionLink,
)
from federation.metering.pricing import Price
from federation.metering.selectors import (
    counted_spend,
    month_of,
    prices_in_effect,
    tenant_month_spend,
)
from federation.routing.leases import BudgetRow, KeyBudget, Published, published_leases
from federation.routing.models import BudgetReport, RoutingTableVersion
from federation.routing.snapshot import (
    ColdRow,
    FleetSnapshot,
    InstanceRow,
    KeyRow,
    RampPolicy,
    RegionRow,
    TenantRow,
)
from federation.tenancy.models import Tenant
from federation.tenancy.residency import ResidencyPolicy
from federation.tenancy.selectors import api_key_budgets, api_key_table_entries
from regions.tables.money import micro_usd, pico_usd
from regions.tables.schema import MAX_EDGE_WORKERS, ModelPrice, TenantPolicy, lease_holders

#: A budget's scope at one edge: (key prefix or "" for the tenant's own, edge name).
Scope = tuple[str, str]
#: vLLM's default ``--max-num-seqs`` when a deployment does not set it.
VLLM_DEFAULT_MAX_NUM_SEQS = 256
#: Key of the instance load snapshot (edge heartbeat) the compiler reads demand from.
LOAD_TOKENS_PER_S = "tokens_per_s"
#: Reports older than this no longer count (an edge that stopped): for load and for health.
LOAD_REPORT_MAX_AGE_S = 60.0


def reported_health(load: Any, now: datetime) -> bool | None:
    """Health from a heartbeat's load snapshot while it is fresh; None when unknown or stale."""
    if not isinstance(load, dict) or not isinstance(load.get("healthy"), bool):
        return None
    try:
        age = (now - datetime.fromisoformat(load["reported_at"])).total_seconds()
    except (TypeError, KeyError, ValueError):
        return None
    return load["healthy"] if age <= LOAD_REPORT_MAX_AGE_S else None


def ramp_policy() -> RampPolicy:
    """The returning-region ramp from the settings (``FEDINFER_RAMP_*``)."""
    return RampPolicy(
        window_s=float(settings.FEDINFER_RAMP_SECONDS), steps=int(settings.FEDINFER_RAMP_STEPS)
    )


def _load_tokens_per_s(load: Any) -> float | None:
    """Tokens/s from a heartbeat's load snapshot; absent or malformed means unknown."""
    if not isinstance(load, dict):
        return None
    value = load.get(LOAD_TOKENS_PER_S)
    if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
        return None
    return float(value)


def tenant_cache_salt(slug: str) -> str:
    """A tenant's secret KV-cache salt: an HMAC of its slug under the deployment's secret key,
    so it is stable across compiles (byte-identical tables) and unguessable to clients; only
    the signed tables, which edges fetch with their credentials, carry it."""
    digest = salted_hmac("fedinfer.kv-cache-salt", slug, algorithm="sha256").digest()
    return base64.urlsafe_b64encode(digest).decode().rstrip("=")


@dataclass(slots=True)
class _TenantRowsMemo:
    """The last rows :func:`tenant_rows` built and everything it built them from (the rows
    read, the spend, the secret key of the cache salts). Equal inputs give the same rows, so
    they are handed back as they are — the same tuple, which lets ``fleet_plan`` see at once
    that its tenants are those of the last plan (``reuse``)."""

    #: (inputs, rows), replaced as one so that a thread never reads a mismatched pair.
    last: tuple[tuple[Any, ...], tuple[TenantRow, ...]] | None = None


_last_tenant_rows = _TenantRowsMemo()


def tenant_rows(
    *,
    now: datetime | None = None,
    spend_usd: Mapping[str, float] | None = None,
    keys_and_budgets: bool = True,
) -> tuple[TenantRow, ...]:
    """Active tenants with their residency policy, limits, budget and usable key hashes.

    ``spend_usd``: tenant slug -> spend this month (metered: ``fleet_snapshot`` reads it).
    Without ``keys_and_budgets``, no key hashes and no budget leases (see ``fleet_snapshot``).
    Every compile reads every tenant, so they are plain rows (not model instances), and the
    few distinct jurisdiction lists are decoded once each rather than once per tenant; when
    nothing they are built from changed since the last call, that call's rows are returned.
    """
    keys: dict[int, list[KeyRow]] = {}
    for entry in api_key_table_entries(now=now) if keys_and_budgets else ():
        keys.setdefault(entry.tenant_id, []).append(
            KeyRow(entry.key_hash, entry.valid_until, entry.scopes)
        )
    spend = spend_usd or {}
    tenants = list(
        Tenant.objects.filter(is_active=True)
        .order_by("slug")
        .values_list(
            "pk",
            "slug",
            Cast("allowed_jurisdictions", TextField()),
            "requests_per_minute",
            "tokens_per_minute",
            "monthly_budget_usd",
            "isolate_kv_cache",
        )
    )
    # One query for every tenant's region list (not a prefetch: thousands of model instances).
    allowed: dict[int, list[str]] = {}
    through = Tenant.allowed_regions.through.objects.values_list("tenant_id", "region__code")
    for tenant_id, code in through:
        allowed.setdefault(tenant_id, []).append(code)
    budgets = (
        budget_rows(
            {slug: budget for _, slug, _, _, _, budget, _ in tenants}, now=now or timezone.now()
        )
        if keys_and_budgets
        else {}
    )
    inputs = (tenants, allowed, keys, budgets, dict(spend), settings.SECRET_KEY)
    last = _last_tenant_rows.last
    if last is not None and last[0] == inputs:
        return last[1]
    policies: dict[tuple[str, tuple[str, ...]], ResidencyPolicy] = {}
    rows = []
    for pk, slug, jurisdictions, rpm, tpm, budget, isolated in tenants:
        regions = tuple(allowed.get(pk, ()))
        policy = policies.get((jurisdictions, regions))
        if policy is None:
            policy = policies[(jurisdictions, regions)] = ResidencyPolicy.of(
                orjson.loads(jurisdictions), regions
            )
        rows.append(
            TenantRow(
                slug=slug,
                policy=policy,
                requests_per_minute=rpm,
                tokens_per_minute=tpm,
                monthly_budget_usd=None if budget is None else float(budget),
                spend_usd=float(spend.get(slug, 0.0)),
                keys=tuple(keys.get(pk, ())),
                cache_salt=tenant_cache_salt(slug) if isolated else None,
                budget=budgets.get(slug),
            )
        )
    built = tuple(rows)
    _last_tenant_rows.last = (inputs, built)
    return built


def budget_rows(budgets: Mapping[str, Decimal | None], *, now: datetime) -> dict[str, BudgetRow]:
    """Tenant slug -> its budgets (its own, its keys') and this month's spend counted against
    them, in pico-USD, for the tenants of ``budgets`` (slug -> monthly budget, None for none)
    that have one or whose keys have one (a fixed number of queries however many there are)."""
    keys: dict[str, list[KeyBudget]] = {}
    for entry in api_key_budgets(now=now):
        if entry.tenant not in budgets:
            continue
        keys.setdefault(entry.tenant, []).append(
            KeyBudget(pico_usd(entry.budget_usd), entry.live, entry.prefixes)
        )
    budgeted = [slug for slug, usd in budgets.items() if usd is not None or slug in keys]
    if not budgeted:
        return {}
    month = month_of(now)
    label = f"{month:%Y-%m}"
    counted = counted_spend(month=month, tenants=budgeted)
    own_prices = prices_in_effect(now=now, tenants=budgeted).tenant_prices
    published, committed = budget_history(label)
    rows = {}
    for slug in budgeted:
        usd = budgets[slug]
        rows[slug] = BudgetRow(
            month=label,
            budget=None if usd is None else pico_usd(usd),
            counted={k: pico_usd(v) for k, v in counted.get(slug, {}).items()},
            published=published.get(slug, {}),
            committed=committed.get(slug, {}),
            key_budgets=tuple(keys.get(slug, ())),
            prices={m: table_price(p) for m, p in own_prices.get(slug, {}).items()},
        )
    return rows


def budget_history(
    month: str,
) -> tuple[dict[str, dict[Scope, Published]], dict[str, dict[Scope, int]]]:
    """What each edge was leased by the last table of its own region (the one it has or will
    apply), and, for the edges that reported while on that table, what they committed (a
    budget an edge left out of its report is at its counted spend). Tenant -> (key, edge)."""
    latest = dict(
        RoutingTableVersion.objects.values("region_id")
        .annotate(last=Max("version"))
        .values_list("region_id", "last")
    )
    if not latest:
        return {}, {}
    edges: dict[int, set[str]] = {}
    for name, region_id in Edge.objects.values_list("name", "region_id"):
        # Any worker it ran may still hold a lease of the last table (lease_holders' bound).
        edges.setdefault(region_id, set()).update(lease_holders(name, MAX_EDGE_WORKERS))
    rows = RoutingTableVersion.objects.filter(
        reduce(operator.or_, (Q(region_id=r, version=v) for r, v in latest.items()))
    )
    published: dict[str, dict[Scope, Published]] = {}
    for region_id, budgeted in _budgeted_tenants(rows):
        ours = edges.get(region_id, set())
        policies = msgspec.convert(budgeted, tuple[TenantPolicy, ...])
        for tenant, scopes in published_leases(policies, month).items():
            mine = {scope: lease for scope, lease in scopes.items() if scope[1] in ours}
            published.setdefault(tenant, {}).update(mine)
    reports = {
        report.holder: report.committed
        for report in BudgetReport.objects.select_related("edge")
        if report.table_version >= latest.get(report.edge.region_id, report.table_version + 1)
    }
    committed: dict[str, dict[Scope, int]] = {}
    for tenant, scopes in published.items():
        for (key, edge), lease in scopes.items():
            if edge in reports:
                amount = reports[edge].get(tenant, {}).get(key, lease.counted)
                committed.setdefault(tenant, {})[(key, edge)] = int(amount)
    return published, committed


def _budgeted_tenants(rows: QuerySet[RoutingTableVersion]) -> list[tuple[int, list[Any]]]:
    """(region id, the tenant entries with a budget) of each table. PostgreSQL picks them out
    of the stored document itself: decoding thousands of tenants to keep a few costs more than
    the compile."""
    if connection.vendor == "postgresql":
        only = RawSQL("jsonb_path_query_array(document, '$.tenants[*] ? (exists(@.budget))')", [])
        found = rows.annotate(budgeted=only).values_list("region_id", "budgeted")
        return [(region_id, orjson.loads(text)) for region_id, text in found]
    return [
        (row.region_id, [t for t in row.document.get("tenants") or () if t.get("budget")])
        for row in rows
    ]


def table_price(price: Price) -> ModelPrice:
    """A price as the tables carry it: micro-USD per million tokens."""
    return ModelPrice(
        micro_usd(price.input_per_mtok),
        micro_usd(price.cached_input_per_mtok),
        micro_usd(price.output_per_mtok),
    )


def fleet_snapshot(
    *,
    now: datetime | None = None,
    spend_usd: Mapping[str, float] | None = None,
    keys_and_budgets: bool = True,
) -> FleetSnapshot:
    """Everything the compiler reads, at ``now`` (default: the current time). A tenant's
    spend this month is what metering rolled up, unless ``spend_usd`` says otherwise.

    ``keys_and_budgets=False`` leaves out tenants' key hashes and budget leases (and so the
    prices that come with leases): what admits a request and how much it may spend at each
    edge, not where it goes. Its tables decide every request's region as the full ones do (the
    residency classes, budget states and the demand split are the same) at a fraction of the
    cost: the console's previews of an action read it."""
    now = now or timezone.now()
    if spend_usd is None:
        spend_usd = {slug: float(usd) for slug, usd in tenant_month_spend(now=now).items()}
    # A region's live edges — a fresh heartbeat, or none yet (just registered) — receive its
    # spill-over and are granted its budgets; with none live, its first registered edge stays
    # its address (failover decides whether the region is gone, not this).
    first_urls: dict[str, str] = {}
    live_urls: dict[str, list[str]] = {}
    live_edges: dict[str, list[str]] = {}
    fresh = now - timedelta(seconds=LOAD_REPORT_MAX_AGE_S)
    edges = Edge.objects.order_by("name").values_list(
        "region__code", "url", "name", "last_heartbeat_at", "workers"
    )
    for code, url, name, heard, workers in edges:
        first_urls.setdefault(code, url)
        if heard is None or heard >= fresh:
            # Each worker process of an edge holds leases and a rate-limit share of its own.
            live_edges.setdefault(code, []).extend(lease_holders(name, workers))
            if url not in live_urls.setdefault(code, []):
                live_urls[code].append(url)
    regions = tuple(
        RegionRow(
            code=r.code,
            status=r.status,
            jurisdiction=r.jurisdiction,
            edge_url=live_urls[r.code][0] if r.code in live_urls else first_urls.get(r.code),
            other_edge_urls=tuple(live_urls.get(r.code, ())[1:]),
            restored_at=r.restored_at,
            recovered_at=r.recovered_at,
            edges=tuple(live_edges.get(r.code, ())),
        )
        for r in Region.objects.all()
    )
    instances = []
    rows = Instance.objects.select_related(
        "deployment__model", "deployment__pool__region", "deployment__pool__accelerator"
    ).prefetch_related("deployment__adapters")
    for inst in rows:
        dep = inst.deployment
        instances.append(
            InstanceRow(
                name=inst.name,
                endpoint_url=inst.endpoint_url,
                state=inst.state,
                region=dep.pool.region.code,
                model=dep.model.name,
                role=dep.role,
                accelerator=dep.pool.accelerator.name,
                relative_speed=dep.pool.accelerator.relative_speed,
                tensor_parallel_size=dep.tensor_parallel_size,
                parameter_count_b=float(dep.model.parameter_count_b),
                max_num_seqs=int(dep.engine_args.get("max-num-seqs", VLLM_DEFAULT_MAX_NUM_SEQS)),
                adapters=tuple(sorted(a.name for a in dep.adapters.all())),
                price_per_gpu_hour=float(dep.pool.price_per_gpu_hour),
                load_tokens_per_s=_load_tokens_per_s(inst.load),
                healthy=reported_health(inst.load, now),
            )
        )
    rtt = {
        (link.source.code, link.target.code): (
            link.measured_rtt_ms if link.measured_rtt_ms is not None else link.rtt_ms
        )
        for link in RegionLink.objects.select_related("source", "target")
    }
    tenants = tenant_rows(now=now, spend_usd=spend_usd, keys_and_budgets=keys_and_budgets)
    list_prices = (
        prices_in_effect(now=now, tenants=()).list_prices
        if any(t.budget is not None for t in tenants)
        else {}
    )
    return FleetSnapshot(
        regions=regions,
        instances=tuple(instances),
        rtt_ms=rtt,
        tenants=tenants,
        now=now,
        ramp=ramp_policy(),
        prices={m: table_price(p) for m, p in list_prices.items()},
        cold=cold_rows(),
        loadable_adapters=loadable_adapters(),
        adapter_load_s=float(settings.FEDINFER_ADAPTER_LOAD_SECONDS),
        private_adapters=private_adapters(),
        adapter_bases=adapter_bases() if list_prices else {},
    )


def private_adapters() -> dict[str, tuple[str, ...]]:
    """Adapter -> the tenants that may use it, for every adapter a tenant owns."""
    owned = LoraAdapter.objects.filter(owner__isnull=False).values_list("name", "owner__slug")
    return {name: (slug,) for name, slug in owned.order_by("name")}


def adapter_bases() -> dict[str, str]:
    """Adapter -> the name of its base model, for every registered adapter."""
    return dict(LoraAdapter.objects.values_list("name", "base_model__name").order_by("name"))


def loadable_adapters() -> tuple[tuple[str, str], ...]:
    """(region, adapter) for every registered adapter whose base model has a ready replica in
    the region on a pool the worker provisions (it can load the adapter there at runtime)."""
    regions = (
        Instance.objects.filter(state=lifecycle.READY, deployment__role=Deployment.Role.MIXED)
        .exclude(deployment__pool__provisioner=GPUPool.Provisioner.STATIC)
        .values_list("deployment__model_id", "deployment__pool__region__code")
        .distinct()
    )
    where: dict[int, set[str]] = {}
    for model_id, code in regions:
        where.setdefault(model_id, set()).add(code)
    if not where:
        return ()
    adapters = LoraAdapter.objects.filter(base_model_id__in=where).values_list(
        "base_model_id", "name"
    )
    return tuple(sorted((code, name) for base, name in adapters for code in where[base]))


def cold_rows() -> tuple[ColdRow, ...]:
    """Deployments that may scale to zero on an active pool and have no ready instance, with
    their measured cold start: creation to ready of their last instance that became ready
    (``FEDINFER_COLD_START_DEFAULT_SECONDS`` before any did)."""
    deployments = list(
        Deployment.objects.filter(
            scale_to_zero_after_s__isnull=False, pool__status=GPUPool.Status.ACTIVE
        )
        .exclude(instances__state=lifecycle.READY)
        .select_related("model", "pool__region")
        .prefetch_related("adapters")
        .order_by("pk")
    )
    if not deployments:
        return ()
    measured: dict[int, float] = {}
    intervals = (
        InstanceInterval.objects.filter(
            instance__deployment__in=deployments, ready_at__isnull=False
        )
        .order_by("-ready_at")
        .values_list("instance__deployment_id", "instance__created_at", "started_at", "ready_at")
    )
    for dep_id, created, started, ready_at in intervals[: 20 * len(deployments)]:
        if dep_id not in measured and ready_at is not None:
            measured[dep_id] = (ready_at - (created or started)).total_seconds()
    default = float(settings.FEDINFER_COLD_START_DEFAULT_SECONDS)
    return tuple(
        ColdRow(
            region=d.pool.region.code,
            model=d.model.name,
            adapters=tuple(sorted(a.name for a in d.adapters.all())),
            cold_start_s=max(1.0, measured.get(d.pk, default)),
        )
        for d in deployments
    )
