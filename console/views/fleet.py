"""The fleet: the overview, regions with their pools and instances, and the actions on them.

Every action is two steps: GET shows what it would do (``console.preview``, computed by the
routing compiler on the fleet as the action would leave it) and asks to confirm; POST calls the
inventory service, which validates, audits and schedules the recompile, like the API does.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.contrib import messages
from django.core.exceptions import ValidationError
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.urls import reverse
from django.utils import timezone
from django.views.decorators.http import require_http_methods

from console import fleet, progress
from console.access import STAFF, console_view
from console.preview import Preview, preview, snapshot_after
from federation.core.errors import Conflict
from federation.inventory import lifecycle
from federation.inventory import selectors as inventory_selectors
from federation.inventory import services as inventory
from federation.inventory.models import GPUPool, Instance, Region
from federation.metering.selectors import recent_requests
from federation.routing.compiler import TARGET_UTILISATION
from federation.routing.distribution import routing_table_overview
from federation.routing.selectors import fleet_snapshot, ramp_policy
from federation.routing.tenant_plan import TenantPlan

#: The window of metered requests the overview's TTFT and spill-over are read from.
TRAFFIC_WINDOW = timedelta(minutes=5)
#: At most this many of them (the newest): enough for a p99, cheap to poll every few seconds.
TRAFFIC_SAMPLE = 5_000


def _partial(request: HttpRequest) -> bool:
    """An htmx poll asks for the live fragment only."""
    return request.headers.get("HX-Request") == "true"


def _instances() -> QuerySet[Instance]:
    return inventory_selectors.instance_list().select_related("deployment__pool__accelerator")


def _cards(now: datetime) -> list[fleet.RegionCard]:
    loads = [fleet.instance_load(i, now) for i in _instances()]
    traffic = [
        fleet.Traffic(*row)
        for row in recent_requests(since=now - TRAFFIC_WINDOW, limit=TRAFFIC_SAMPLE)
    ]
    return fleet.region_cards(routing_table_overview(), loads, traffic, now=now, ramp=ramp_policy())


@console_view(*STAFF)
def overview(request: HttpRequest) -> HttpResponse:
    now = timezone.now()
    cards = _cards(now)
    context = {
        "cards": cards,
        "alerts": fleet.alerts(cards, now),
        "now": now,
        "target": TARGET_UTILISATION,
        "band": (fleet.TARGET_LOW, fleet.TARGET_HIGH),
        "window_minutes": int(TRAFFIC_WINDOW.total_seconds() // 60),
    }
    template = (
        "console/partials/overview_grid.html" if _partial(request) else "console/overview.html"
    )
    return render(request, template, context)


@console_view(*STAFF)
def region_list(request: HttpRequest) -> HttpResponse:
    """Regions and the GPU inventory: pools by accelerator, price and capacity type."""
    q = request.GET.get("q", "").strip()
    pools = inventory_selectors.pool_list()
    regions = inventory_selectors.region_list()
    if q:
        regions = regions.filter(code__icontains=q) | regions.filter(name__icontains=q)
        pools = pools.filter(region__in=regions)
    by_region: dict[int, list[GPUPool]] = {}
    for pool in pools:
        by_region.setdefault(pool.region_id, []).append(pool)
    rows = [(r, by_region.get(r.pk, [])) for r in regions]
    return render(request, "console/regions.html", {"rows": rows, "q": q})


def _timeouts() -> progress.Timeouts:
    """The fleet worker's state timeouts (``FEDINFER_FLEET_*_TIMEOUT_SECONDS``)."""
    return progress.Timeouts(
        loading_s=float(settings.FEDINFER_FLEET_LOADING_TIMEOUT_SECONDS),
        warming_s=float(settings.FEDINFER_FLEET_WARMING_TIMEOUT_SECONDS),
        drain_s=float(settings.FEDINFER_FLEET_DRAIN_TIMEOUT_SECONDS),
    )


@console_view(*STAFF)
def region_detail(request: HttpRequest, code: str) -> HttpResponse:
    """A region's pools, instances (live, with the progress of their long states) and edges."""
    region = get_object_or_404(inventory_selectors.region_list(), code=code)
    now = timezone.now()
    timeouts = _timeouts()
    instances = [
        (
            i,
            fleet.instance_load(i, now),
            progress.instance_progress(
                state=i.state,
                since=i.state_changed_at,
                drain_reason=i.drain_reason,
                in_flight=progress.fresh_in_flight(i.load, now),
                now=now,
                timeouts=timeouts,
            ),
        )
        for i in _instances()
        .filter(deployment__pool__region=region)
        .order_by("deployment__pool__name", "name")
    ]
    ramp = progress.ramp_progress(
        status=region.status,
        restored_at=region.restored_at,
        recovered_at=region.recovered_at,
        now=now,
        policy=ramp_policy(),
    )
    context = {"region": region, "instances": instances, "ramp": ramp, "now": now}
    if _partial(request):
        return render(request, "console/partials/instances.html", context)
    context |= {
        "pools": inventory_selectors.pool_list().filter(region=region),
        "edges": inventory_selectors.edge_list().filter(region=region),
    }
    return render(request, "console/region.html", context)


# --- actions -------------------------------------------------------------------------------


@dataclass(slots=True)
class _LastPreview:
    """The tenants' part of the last preview's plan: the next one reuses it when the
    tenants and regions are the same (``fleet_plan`` compares; with unchanged tenants the
    snapshot hands back the very same rows, so that is quick)."""

    tenant_plan: TenantPlan | None = None


_last_preview = _LastPreview()


def _preview(**changes: Mapping[str, Any]) -> Preview:
    # Keys and budget leases do not decide where a request goes (``fleet_snapshot``).
    snapshot = fleet_snapshot(keys_and_budgets=False)
    result = preview(snapshot, snapshot_after(snapshot, **changes), reuse=_last_preview.tenant_plan)
    _last_preview.tenant_plan = result.tenant_plan
    return result


def _act(
    request: HttpRequest,
    *,
    title: str,
    summary: str,
    back: str,
    run: Callable[[], Any],
    done: str,
    changes: Callable[[], dict[str, Mapping[str, Any]]] | None,
    danger: bool = False,
) -> HttpResponse:
    """GET: the confirmation page, whose preview (``?preview=1``, fetched by htmx as it
    loads: compiling every table takes a while on a big fleet) says what will happen;
    POST: run the service, say what happened."""
    if request.method == "POST":
        try:
            run()
        except (Conflict, ValidationError) as exc:
            messages.error(request, "; ".join(getattr(exc, "messages", None) or [str(exc)]))
        else:
            messages.success(request, done)
        return redirect(back)
    if changes is not None and request.GET.get("preview") == "1":
        fragment = {"preview": _preview(**changes())}
        return render(request, "console/partials/preview.html", fragment)
    context = {
        "title": title,
        "summary": summary,
        "back": back,
        "danger": danger,
        "has_preview": changes is not None,
    }
    return render(request, "console/confirm.html", context)


def _region(code: str) -> Region:
    return get_object_or_404(inventory_selectors.region_list(), code=code)


@require_http_methods(["GET", "POST"])
@console_view(*STAFF)
def region_evacuate(request: HttpRequest, code: str) -> HttpResponse:
    region = _region(code)

    def changes() -> dict[str, Mapping[str, Any]]:
        ready = _instances().filter(deployment__pool__region=region, state=lifecycle.READY)
        return {
            "region_status": {region.code: Region.Status.EVACUATED},
            "instance_states": {i.name: lifecycle.DRAINING for i in ready},
        }

    return _act(
        request,
        title=f"Evacuate region {region.code}",
        summary=(
            f"{region.code} takes no more traffic: its ready instances drain (requests in "
            "flight finish) and its edges forward what they receive to the regions each "
            "tenant may use."
        ),
        back=reverse("console:region", args=[region.code]),
        run=lambda: inventory.region_evacuate(actor=request.user, region=region),
        done=f"Region {region.code} evacuated; the new routing tables are being published.",
        changes=changes,
        danger=True,
    )


@require_http_methods(["GET", "POST"])
@console_view(*STAFF)
def region_restore(request: HttpRequest, code: str) -> HttpResponse:
    region = _region(code)

    def changes() -> dict[str, Mapping[str, Any]]:
        drained = _instances().filter(
            deployment__pool__region=region,
            state=lifecycle.DRAINING,
            drain_reason=Instance.DrainReason.EVACUATION,
        )
        restored = {region.code: timezone.now()} if region.status == Region.Status.EVACUATED else {}
        return {
            "region_status": {region.code: Region.Status.ACTIVE},
            "restored_at": restored,
            "instance_states": {i.name: lifecycle.READY for i in drained},
        }

    return _act(
        request,
        title=f"Restore region {region.code}",
        summary=(
            f"{region.code} takes traffic again. The instances its evacuation drained return; "
            "those an operator drained stay drained. Traffic comes back in steps (the ramp), "
            "so the preview shows its first step."
        ),
        back=reverse("console:region", args=[region.code]),
        run=lambda: inventory.region_restore(actor=request.user, region=region),
        done=f"Region {region.code} restored; its traffic ramps back.",
        changes=changes,
    )


def _pool(pk: int) -> GPUPool:
    return get_object_or_404(inventory_selectors.pool_list(), pk=pk)


@require_http_methods(["GET", "POST"])
@console_view(*STAFF)
def pool_cordon(request: HttpRequest, pk: int) -> HttpResponse:
    pool = _pool(pk)
    return _act(
        request,
        title=f"Cordon pool {pool}",
        summary=(
            f"No new deployments or replicas on {pool}; its running instances keep serving, "
            "so routing does not change (the preview below is the compiler's answer)."
        ),
        back=reverse("console:region", args=[pool.region.code]),
        run=lambda: inventory.pool_cordon(actor=request.user, pool=pool),
        done=f"Pool {pool} cordoned.",
        changes=dict,
    )


@require_http_methods(["GET", "POST"])
@console_view(*STAFF)
def pool_uncordon(request: HttpRequest, pk: int) -> HttpResponse:
    pool = _pool(pk)
    return _act(
        request,
        title=f"Uncordon pool {pool}",
        summary=f"{pool} accepts new deployments and replicas again.",
        back=reverse("console:region", args=[pool.region.code]),
        run=lambda: inventory.pool_uncordon(actor=request.user, pool=pool),
        done=f"Pool {pool} uncordoned.",
        changes=None,
    )


def _instance(name: str) -> Instance:
    return get_object_or_404(_instances(), name=name)


@require_http_methods(["GET", "POST"])
@console_view(*STAFF)
def instance_drain(request: HttpRequest, name: str) -> HttpResponse:
    inst = _instance(name)
    region = inst.deployment.pool.region.code
    return _act(
        request,
        title=f"Drain instance {inst.name}",
        summary=(
            f"{inst.name} gets no new requests; the ones in flight finish. It stays drained "
            "until an operator undrains it (restoring its region does not)."
        ),
        back=reverse("console:region", args=[region]),
        run=lambda: inventory.instance_drain(actor=request.user, instance=inst),
        done=f"Instance {inst.name} is draining.",
        changes=lambda: {"instance_states": {inst.name: lifecycle.DRAINING}},
    )


@require_http_methods(["GET", "POST"])
@console_view(*STAFF)
def instance_undrain(request: HttpRequest, name: str) -> HttpResponse:
    inst = _instance(name)
    region = inst.deployment.pool.region.code
    return _act(
        request,
        title=f"Undrain instance {inst.name}",
        summary=f"{inst.name} receives requests again.",
        back=reverse("console:region", args=[region]),
        run=lambda: inventory.instance_undrain(actor=request.user, instance=inst),
        done=f"Instance {inst.name} is ready again.",
        changes=lambda: {"instance_states": {inst.name: lifecycle.READY}},
    )
