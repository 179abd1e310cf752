"""Writes of the distribution side: publishing table versions, edge credentials, the budget
reports edges send (stored for ``federation.telemetry``, which ingests heartbeats), and
scheduling the debounced recompile after inventory and tenancy changes (handed every recorded
change through ``federation.core.changes``; ``RoutingConfig.ready`` sets ``TABLE_SCHEDULER``).

Publishing locks the per-region version counters *before* reading the fleet, so two
compilers run one after the other and the later one always sees at least what the earlier
one saw: versions only go up, and a newer version never carries an older fleet.
"""

from __future__ import annotations

import gc
import logging
import secrets
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from datetime import datetime

import redis
from celery import current_app
from django.conf import settings
from django.db import transaction
from django.db.models import Exists, F, OuterRef, Subquery, Window
from django.db.models.functions import RowNumber
from django.utils import timezone
from redis.connection import parse_url

from federation.core import metrics
from federation.core.audit import Actor, audit_record
from federation.core.changes import TableScheduler
from federation.core.models import AuditEvent
from federation.core.services import model_lock
from federation.inventory.models import Edge, Region
from federation.routing.changed_tables import compile_changed_tables
from federation.routing.models import BudgetReport, RoutingTableCounter, RoutingTableVersion
from federation.routing.selectors import fleet_snapshot
from federation.routing.tenant_plan import TenantPlan
from federation.tenancy.keys import EDGE_CREDENTIAL_PREFIX, hash_key

logger = logging.getLogger(__name__)

#: Set while a recompile is queued: further changes within that window ride along.
RECOMPILE_PENDING_KEY = "fedinfer:tables:recompile-pending"
#: Let a burst of changes settle before compiling (many changes in a second, one compile).
RECOMPILE_DELAY_S = 0.2
#: The pending mark expires on its own, so a lost task cannot block recompiles for good.
RECOMPILE_PENDING_TTL_MS = 10_000
#: Redis key that spaces budget re-leases (see ``routing_tables_schedule_budget_release``).
BUDGET_RELEASE_KEY = "fedinfer:routing:budget-release"


class _Spacing:
    last = float("-inf")


_budget_release = _Spacing()


class _LastFullPublish:
    """When this process last started a publish of every region's table that succeeded
    (wall clock)."""

    started_at = float("-inf")


_last_full_publish = _LastFullPublish()


class _LastTenants:
    """The tenants' part of this process's last compile, for the next to reuse when the
    tenants have not changed (``fleet_plan`` checks): a change to one instance then costs no
    tenant work. One plan, replaced by each compile."""

    plan: TenantPlan | None = None


_last_tenants = _LastTenants()
#: One queued recompile per ramp step boundary (key + its epoch milliseconds).
RAMP_STEP_KEY = "fedinfer:tables:ramp-step:{at_ms}"
#: Compile a little after the boundary, so that the level has moved.
RAMP_STEP_SLACK_S = 0.05
#: The Celery task that recompiles and publishes tables (``workers.tasks``), queued by name so
#: this domain never imports the workers that import it.
PUBLISH_TASK = "fedinfer.routing_tables.publish"
#: Audit actions that change nothing a table contains.
ACTIONS_WITHOUT_RECOMPILE = frozenset({"edge.rotate_credential"})
#: Tenancy changes that can take access away (a key revoked, rotated, deleted, narrowed; a
#: tenant deactivated, deleted or restricted). Their tables are published by the request that
#: made them, once it commits, instead of by the worker: a revocation reaches the edges even
#: while the worker or Redis is down.
ACTIONS_PUBLISHED_AT_ONCE = frozenset(
    {
        "api_key.revoke",
        "api_key.rotate",
        "api_key.delete",
        "api_key.update",
        "tenant.deactivate",
        "tenant.delete",
        "tenant.update",
    }
)


def redis_client() -> redis.Redis | None:
    """A client for ``REDIS_URL``, or None in embedded mode (no Redis configured)."""
    url = settings.REDIS_URL
    if not url:
        return None
    return redis.Redis.from_url(url, socket_timeout=2, socket_connect_timeout=2)


def nudge_channel(region_code: str) -> str:
    """The Redis channel an edge's long-poll for ``region_code`` waits on; each message is a
    new version. Pub/sub channels belong to the server, not to a database, so the name carries
    ``REDIS_URL``'s database: control planes sharing one Redis on different databases do not
    wake each other's edges. Without Redis (embedded mode) nothing is sent or awaited on it."""
    url = settings.REDIS_URL
    database = parse_url(url).get("db", 0) if url else 0
    return f"fedinfer:tables:{database}:{region_code}"


# --- publishing ----------------------------------------------------------------------------


def _locked_counters(codes: Sequence[str]) -> dict[str, RoutingTableCounter]:
    """Create missing counters, then lock them all in code order (no deadlock between two
    publishers of overlapping region sets)."""
    RoutingTableCounter.objects.bulk_create(
        [RoutingTableCounter(region_code=c) for c in codes], ignore_conflicts=True
    )
    locked = (
        RoutingTableCounter.objects.select_for_update()
        .filter(region_code__in=codes)
        .order_by("region_code")
    )
    return {c.region_code: c for c in locked}


def _publish_nudges(versions: Iterable[RoutingTableVersion]) -> None:
    """Wake the long-polls of edges waiting for these regions. Without Redis they notice on
    their next database poll, so a failure here delays, never loses, a table."""
    pairs = [(v.region.code, v.version) for v in versions]
    client = redis_client()
    if client is None or not pairs:
        return
    try:
        with client.pipeline(transaction=False) as pipe:
            for code, version in pairs:
                pipe.publish(nudge_channel(code), str(version))
            pipe.execute()
    except redis.RedisError as exc:
        logger.warning("table nudge not sent (edges fall back to polling): %s", exc)
    finally:
        client.close()


@contextmanager
def without_cyclic_gc() -> Iterator[None]:
    """Hold the cyclic garbage collector off for a compile: it allocates millions of
    short-lived, acyclic objects (reference counting frees them) beside the large tables a
    worker keeps, and each full collection walked all of them — a fifth of a compile's time at
    50,000 tenants (``python -m bench scale``). Cycles made meanwhile are collected after."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


@metrics.TABLE_COMPILE.time()
def routing_tables_publish(*, regions: Sequence[str] | None = None) -> list[RoutingTableVersion]:
    """Compile the tables of ``regions`` (default: all) and store those whose content changed,
    each under its region's next version. Returns the new versions (empty: nothing changed)."""
    with transaction.atomic():
        region_qs = Region.objects.order_by("code")
        if regions is not None:
            region_qs = region_qs.filter(code__in=list(regions))
        codes = list(region_qs.values_list("code", flat=True))
        if not codes:
            return []
        counters = _locked_counters(codes)
        # Read the fleet only now, under the locks: a later publisher sees at least this.
        snapshot = fleet_snapshot()
        latest = RoutingTableVersion.objects.filter(region=OuterRef("pk")).order_by("-version")
        targets = {
            region.code: region
            for region in Region.objects.filter(code__in=codes).annotate(
                latest_hash=Subquery(latest.values("body_hash")[:1])
            )
        }
        with without_cyclic_gc():
            plan, changed = compile_changed_tables(
                snapshot,
                latest={c: (counters[c].last_version, targets[c].latest_hash) for c in codes},
                generated_at=timezone.now().isoformat().replace("+00:00", "Z"),
                reuse=_last_tenants.plan,
            )
        _last_tenants.plan = plan.tenant_plan
        created: list[RoutingTableVersion] = []
        for table in changed:
            counter = counters[table.region]
            counter.last_version += 1
            counter.save(update_fields=["last_version"])
            created.append(
                RoutingTableVersion.objects.create(
                    region=targets[table.region],
                    version=counter.last_version,
                    document=table.document,
                    body_hash=table.body_hash,
                )
            )
        if created:
            transaction.on_commit(lambda: _publish_nudges(created))
            transaction.on_commit(lambda: metrics.tables_published(v.region.code for v in created))
        if plan.next_ramp_change_s is not None:
            at = snapshot.now or timezone.now()
            delay = plan.next_ramp_change_s + RAMP_STEP_SLACK_S
            transaction.on_commit(lambda: routing_tables_schedule_ramp_step(at, delay), robust=True)
    return created


def routing_tables_prune(*, keep: int, older_than: datetime, batch: int = 1000) -> int:
    """Delete the published versions nobody needs any more; how many went. A region's newest
    ``keep`` versions stay, and so does every version created at or after ``older_than`` and
    every one an edge of the region reports as applied (what it serves, and what a restarted
    control plane must still recognise). Each version carries the whole table — every tenant
    — and a fleet with budgets publishes one every few seconds, so without this the table
    grows without end. In batches of ``batch``: no delete holds a long lock."""
    if keep < 1:
        raise ValueError("keep at least the newest version of each region")
    # Ranked over all of a region's versions, apart from the other conditions: filtered
    # together, the window would rank only the old ones and keep the newest of those.
    beyond_newest = (
        RoutingTableVersion.objects.annotate(
            newer=Window(RowNumber(), partition_by=[F("region_id")], order_by=F("version").desc())
        )
        .filter(newer__gt=keep)
        .values("pk")
    )
    applied = Edge.objects.filter(
        region_id=OuterRef("region_id"), applied_table_version=OuterRef("version")
    )
    expired = (
        RoutingTableVersion.objects.filter(pk__in=beyond_newest, created_at__lt=older_than)
        .exclude(Exists(applied))
        .values_list("pk", flat=True)
    )
    deleted = 0
    while ids := list(expired[:batch]):
        deleted += RoutingTableVersion.objects.filter(pk__in=ids).delete()[0]
    return deleted


def routing_tables_schedule_ramp_step(compiled_at: datetime, delay_s: float) -> bool:
    """Queue the recompile that publishes a ramp's next step, once per step boundary however
    many publishes saw it coming (a Redis ``SET NX`` keyed by the boundary's time); without
    Redis every caller queues one, which costs an unchanged compile. Returns True if queued."""
    at_ms = round((compiled_at.timestamp() + delay_s) * 1000)
    key = RAMP_STEP_KEY.format(at_ms=at_ms)
    return _publish_once(key, round(delay_s * 1000) + 60_000, delay_s, "ramp step")


# --- the debounced recompile ---------------------------------------------------------------


def routing_tables_schedule_recompile() -> bool:
    """Queue one publish ``RECOMPILE_DELAY_S`` from now unless one is already pending.

    Returns True when a task was queued. The pending mark lives in Redis (shared by every
    web process and cleared by the task when it starts); without Redis every call queues a
    task, which is harmless: an unchanged fleet publishes nothing.
    """
    return _publish_once(
        RECOMPILE_PENDING_KEY, RECOMPILE_PENDING_TTL_MS, RECOMPILE_DELAY_S, "recompile"
    )


def routing_tables_schedule_budget_release() -> bool:
    """Queue a recompile after a budgeted tenant's spend was counted, so the edges get their
    leases of what now remains (``docs/adr/0008-budget-leases.md``): at most one per
    ``FEDINFER_BUDGET_RELEASE_SECONDS`` (ingestion commits every few seconds, a compile of
    thousands of tenants takes about one); the periodic publish covers what falls between.
    Spaced in this process too, for the demo, which has no Redis to share the mark."""
    interval = float(settings.FEDINFER_BUDGET_RELEASE_SECONDS)
    now = time.monotonic()
    if now - _budget_release.last < interval:
        return False
    _budget_release.last = now
    return _publish_once(
        BUDGET_RELEASE_KEY,
        int(settings.FEDINFER_BUDGET_RELEASE_SECONDS * 1000),
        RECOMPILE_DELAY_S,
        "budget re-lease",
    )


def _publish_once(key: str, ttl_ms: int, countdown_s: float, what: str) -> bool:
    """Queue a publish in ``countdown_s`` unless ``key`` is already set (Redis ``SET NX PX``);
    without Redis, or when it fails, queue anyway (a duplicate compile publishes nothing)."""
    client = redis_client()
    if client is not None:
        try:
            first = client.set(key, "1", nx=True, px=ttl_ms)
        except redis.RedisError as exc:
            logger.warning("%s debounce unavailable, queueing anyway: %s", what, exc)
            first = True
        finally:
            client.close()
        if not first:
            return False
    due_at = time.time() + countdown_s
    current_app.send_task(PUBLISH_TASK, kwargs={"due_at": due_at}, countdown=countdown_s)
    return True


def routing_tables_recompile(
    *, regions: Sequence[str] | None = None, due_at: float | None = None
) -> list[RoutingTableVersion]:
    """What the queued and the periodic task run: claim the pending mark, then publish.

    Without Redis (the embedded demo) nothing debounces: every change queues a publish, and
    a burst of them compiled back to back held SQLite's write lock for seconds, stalling the
    web's one thread. There a queued full publish (``due_at``: the wall-clock time it was
    queued to run) is skipped when a full publish of this process started after that time:
    it read the fleet after the change that queued this one had committed. With Redis the
    pending mark debounces instead (and hosts' clocks need not agree).
    """
    coalesce = regions is None and not settings.REDIS_URL
    if coalesce and due_at is not None and due_at < _last_full_publish.started_at:
        return []
    started_at = time.time()
    _recompile_claim()
    published = routing_tables_publish(regions=regions)
    if coalesce:  # only once it succeeded: a failed one's retry must not skip itself
        _last_full_publish.started_at = started_at
    return published


def _recompile_claim() -> None:
    """Clear the pending mark as a recompile starts: changes committed from now on queue a
    new one, changes committed before are in the snapshot this recompile reads."""
    client = redis_client()
    if client is None:
        return
    try:
        client.delete(RECOMPILE_PENDING_KEY)
    except redis.RedisError as exc:
        # The mark expires by itself within RECOMPILE_PENDING_TTL_MS.
        logger.warning("recompile mark not cleared: %s", exc)
    finally:
        client.close()


def routing_tables_publish_now() -> list[RoutingTableVersion]:
    """Publish the tables in this process, now: after a change that takes access away.

    Every region's table is compiled, since every table carries every tenant (an edge may
    forward a request elsewhere, so it authenticates all of them); only the changed ones are
    stored. The Redis nudge stays best-effort: edges that miss it poll the database. If the
    publish itself fails, the worker's debounced recompile is queued instead.
    """
    try:
        return routing_tables_publish()
    except Exception:
        logger.exception("publishing the routing tables at once failed; queueing a recompile")
        routing_tables_schedule_recompile()
        return []


def routing_tables_schedule_for_change(event: AuditEvent) -> None:
    """What a recorded change sets off (``audit_record`` hands every event here, through
    ``federation.core.changes``): an inventory or tenancy change schedules a recompile once it
    commits; one that takes access away (``ACTIONS_PUBLISHED_AT_ONCE``) is published by this
    request then. Called inside the recording transaction, so a rollback schedules nothing."""
    if event.action in ACTIONS_WITHOUT_RECOMPILE:
        return
    if event.action in ACTIONS_PUBLISHED_AT_ONCE:
        transaction.on_commit(routing_tables_publish_now, robust=True)
    elif event.object_type.startswith(("inventory.", "tenancy.")):
        transaction.on_commit(routing_tables_schedule_recompile, robust=True)


#: Routing's answer to the domains below it (``federation.core.changes``), set at start-up.
TABLE_SCHEDULER = TableScheduler(
    change_recorded=routing_tables_schedule_for_change,
    budget_spend_counted=routing_tables_schedule_budget_release,
)


# --- budget reports ------------------------------------------------------------------------


def budget_report_store(
    *,
    edge: Edge,
    holder: str,
    table_version: int,
    budgets: Mapping[tuple[str, str], int],
    at: datetime,
) -> None:
    """Keep what ``holder`` (an edge's worker, ``lease_holder``) last reported having committed
    of the budgets it holds leases of (``(tenant, key prefix or "") -> pico-USD``), under the
    table version it applied: what the next compile lowers an unused ceiling from
    (``leases.py``). Telemetry, not a change: no audit event, no recompile."""
    committed: dict[str, dict[str, int]] = {}
    for (tenant, key), amount in budgets.items():
        committed.setdefault(tenant, {})[key] = amount
    BudgetReport.objects.update_or_create(
        holder=holder,
        defaults={
            "edge": edge,
            "table_version": table_version,
            "committed": committed,
            "reported_at": at,
        },
    )


# --- edge credentials ----------------------------------------------------------------------


@transaction.atomic
def edge_credential_rotate(*, actor: Actor, edge: Edge) -> str:
    """Give the edge a new credential and return its plaintext (shown this once; only the
    hash is stored). The old credential stops working at once."""
    edge = model_lock(edge)
    plaintext = EDGE_CREDENTIAL_PREFIX + secrets.token_urlsafe(32)
    edge.credential_hash = hash_key(plaintext)
    edge.save(update_fields=["credential_hash", "updated_at"])
    audit_record(actor=actor, action="edge.rotate_credential", obj=edge)
    return plaintext
