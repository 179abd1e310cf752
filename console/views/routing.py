"""Routing: each region's published table, the diff between two versions, and the request
inspector (where a request would go and why, by the edge's own rules on the current tables)."""

from __future__ import annotations

from typing import Any

from django.core.paginator import Paginator
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, render

from console.access import STAFF, console_view
from console.explain import decide, request_point
from console.forms import InspectForm, TableDiffForm
from console.tablediff import SCALARS, SECTIONS, diff_from_changes
from console.tablediff import table_diff as diff_documents
from federation.inventory import selectors as inventory_selectors
from federation.routing import distribution
from federation.tenancy.selectors import tenant_list
from regions.tables.schema import RoutingTable, decode_table

TENANTS_PER_PAGE = 50


@console_view(*STAFF)
def routing_index(request: HttpRequest) -> HttpResponse:
    return render(
        request, "console/routing.html", {"regions": distribution.routing_table_overview()}
    )


def _int(value: str | None) -> int | None:
    return int(value) if value and value.isdigit() else None


@console_view(*STAFF)
def region_table(request: HttpRequest, code: str) -> HttpResponse:
    region = get_object_or_404(inventory_selectors.region_list(), code=code)
    found = distribution.routing_table_without_tenants(
        region=region, version=_int(request.GET.get("v"))
    )
    if found is None:
        raise Http404("No such routing table version.")
    table, doc, tenant_count = found
    q = request.GET.get("q", "").strip()
    tenants = distribution.table_tenants(table, contains=q, total=tenant_count)
    page = Paginator(tenants, TENANTS_PER_PAGE).get_page(request.GET.get("page"))
    context = {
        "region": region,
        "table": table,
        "doc": doc,
        "tenants": page,
        "tenant_count": tenant_count,
        "q": q,
        "version_query": f"v={table.version}",
        "versions": distribution.routing_table_versions(region=region)[:50],
    }
    return render(request, "console/routing_table.html", context)


@console_view(*STAFF)
def table_diff(request: HttpRequest, code: str) -> HttpResponse:
    region = get_object_or_404(inventory_selectors.region_list(), code=code)
    latest = distribution.routing_table_latest_version(region_id=region.pk)
    if latest is None:
        raise Http404("No routing table has been published for this region.")
    if "old" in request.GET or "new" in request.GET:
        form = TableDiffForm(request.GET)
    else:
        form = TableDiffForm({"old": max(latest - 1, 1), "new": latest})
    diff = old = new = None
    if form.is_valid():
        data = form.cleaned_data
        old = distribution.routing_table_at(region=region, version=data["old"], document=False)
        new = distribution.routing_table_at(region=region, version=data["new"], document=False)
        for name, found in (("old", old), ("new", new)):
            if found is None:
                form.add_error(name, f"{region.code} has no version {data[name]}.")
        if old is not None and new is not None:
            changes = distribution.routing_table_changes(
                old=old, new=new, sections=SECTIONS, scalars=SCALARS
            )
            diff = (
                diff_documents(old.document, new.document)  # not PostgreSQL: whole documents
                if changes is None
                else diff_from_changes(*changes)
            )
    context = {"region": region, "form": form, "diff": diff, "old": old, "new": new}
    return render(request, "console/routing_diff.html", context)


def _table_of(region: Any, tenant: str) -> RoutingTable | None:
    """The region's latest table with ``tenant``'s entry alone among its tenants: a decision
    reads the tenant's policy, the routes, remotes and classes, never the other tenants."""
    stored = distribution.routing_table_for_tenant(region=region, tenant=tenant)
    return None if stored is None else decode_table(stored[1])


@console_view(*STAFF)
def inspect(request: HttpRequest) -> HttpResponse:
    """Compose a request; see which region serves it and why, or why it is refused."""
    regions = list(inventory_selectors.region_list())
    models = [m.name for m in inventory_selectors.model_list()]
    models += [a.name for a in inventory_selectors.adapter_list()]
    bound = bool(request.GET)
    form = InspectForm(
        request.GET if bound else None, models=models, regions=[r.code for r in regions]
    )
    context: dict[str, Any] = {"form": form}
    if bound and form.is_valid():
        data = form.cleaned_data
        tenant = tenant_list(user=request.user).filter(slug=data["tenant"]).first()
        origin = next(r for r in regions if r.code == data["origin"])
        table = _table_of(origin, data["tenant"])
        policy = None
        if tenant is None:
            form.add_error("tenant", f"No tenant {data['tenant']!r}.")
        elif table is None:
            form.add_error("origin", f"No routing table has been published for {origin.code}.")
        else:
            policy = next((t for t in table.tenants or () if t.tenant == tenant.slug), None)
            if policy is None:
                form.add_error(
                    "tenant",
                    f"{tenant.slug} is not in {origin.code}'s table (version {table.version}): "
                    "inactive, or created after that table was published.",
                )
        if policy is not None and table is not None:
            point = request_point(data["session"], data["prompt"])
            context |= {
                "table": table,
                "policy": policy,
                "decision": decide(table, policy, data["model"], point=point),
                "route": next((r for r in table.routes if r.model == data["model"]), None),
                "point": point,
            }
    return render(request, "console/inspect.html", context)
