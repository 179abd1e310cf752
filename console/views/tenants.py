"""Tenants: residency, limits, budget use, usage, and their API keys (create with the secret
shown once, revoke, rotate). Tenants are loaded through the tenant-scoped selectors, so a
tenant viewer finds only its own (another tenant's pages answer 404)."""

from __future__ import annotations

from datetime import UTC, datetime, time, timedelta

from django.contrib import messages
from django.core.exceptions import ValidationError
from django.core.paginator import Paginator
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.utils import timezone
from django.views.decorators.http import require_http_methods

from console.access import EVERYONE, STAFF, console_view
from console.charts import chart_series
from console.forms import ApiKeyCreateForm, ApiKeyRotateForm, add_service_errors
from federation.core.errors import Conflict
from federation.core.roles import is_staff_role
from federation.metering.selectors import UsageQuery, tenant_month_spend, usage_report
from federation.tenancy import selectors, services
from federation.tenancy.models import ApiKey, Tenant

TENANTS_PER_PAGE = 50
#: Days of usage charted on a tenant's page.
CHART_DAYS = 30


@console_view(*EVERYONE)
def tenant_list(request: HttpRequest) -> HttpResponse:
    q = request.GET.get("q", "").strip()
    tenants = selectors.tenant_list(user=request.user).order_by("slug")
    if q:
        tenants = tenants.filter(slug__icontains=q) | tenants.filter(name__icontains=q)
    page = Paginator(tenants, TENANTS_PER_PAGE).get_page(request.GET.get("page"))
    spend = tenant_month_spend(now=timezone.now())
    rows = [(t, spend.get(t.slug)) for t in page]
    return render(request, "console/tenants.html", {"page": page, "rows": rows, "q": q})


def _tenant(request: HttpRequest, slug: str) -> Tenant:
    return get_object_or_404(selectors.tenant_list(user=request.user), slug=slug)


def _no_store(response: HttpResponse) -> HttpResponse:
    """A page with a secret on it is not kept by the browser or a proxy."""
    response["Cache-Control"] = "no-store"
    return response


@console_view(*EVERYONE)
def tenant_detail(request: HttpRequest, slug: str) -> HttpResponse:
    tenant = _tenant(request, slug)
    now = timezone.now()
    spend = tenant_month_spend(now=now).get(tenant.slug)
    budget = tenant.monthly_budget_usd
    end = datetime.combine(now.astimezone(UTC).date(), time(0), tzinfo=UTC) + timedelta(days=1)
    rows = usage_report(
        UsageQuery(
            start=end - timedelta(days=CHART_DAYS),
            end=end,
            group_by=["model"],
            bucket="day",
            filters={"tenant": [tenant.slug]},
        )
    )
    context = {
        "tenant": tenant,
        "regions": selectors.tenant_permitted_regions(tenant),
        "keys": selectors.api_key_list(user=request.user).filter(tenant=tenant),
        "now": now,
        "spend": spend,
        "budget_share": float(spend or 0) / float(budget) if budget else None,
        "chart": chart_series(rows, time_key="day", group_key="model", metric="price_usd"),
        "chart_days": CHART_DAYS,
        "can_write": is_staff_role(request.user),
    }
    return render(request, "console/tenant.html", context)


def _issued(request: HttpRequest, issued: services.IssuedKey, verb: str) -> HttpResponse:
    context = {"key": issued.api_key, "plaintext": issued.plaintext, "verb": verb}
    return _no_store(render(request, "console/key_issued.html", context))


@require_http_methods(["GET", "POST"])
@console_view(*STAFF)
def key_create(request: HttpRequest, slug: str) -> HttpResponse:
    tenant = _tenant(request, slug)
    form = ApiKeyCreateForm(request.POST or None)
    if request.method == "POST" and form.is_valid():
        try:
            issued = services.api_key_create(actor=request.user, tenant=tenant, **form.cleaned_data)
        except (ValidationError, Conflict) as exc:
            add_service_errors(form, exc)
        else:
            return _issued(request, issued, "created")
    return render(request, "console/key_form.html", {"tenant": tenant, "form": form})


def _key(request: HttpRequest, pk: int) -> ApiKey:
    return get_object_or_404(selectors.api_key_list(user=request.user), pk=pk)


@require_http_methods(["GET", "POST"])
@console_view(*STAFF)
def key_revoke(request: HttpRequest, pk: int) -> HttpResponse:
    key = _key(request, pk)
    if request.method == "POST":
        try:
            services.api_key_revoke(actor=request.user, api_key=key)
        except Conflict as exc:
            messages.error(request, str(exc))
        else:
            messages.success(request, f"Key {key.prefix}… revoked; the edges refuse it now.")
        return redirect("console:tenant", slug=key.tenant.slug)
    return render(request, "console/key_revoke.html", {"key": key})


@require_http_methods(["GET", "POST"])
@console_view(*STAFF)
def key_rotate(request: HttpRequest, pk: int) -> HttpResponse:
    key = _key(request, pk)
    form = ApiKeyRotateForm(request.POST or None)
    if request.method == "POST" and form.is_valid():
        try:
            issued = services.api_key_rotate(
                actor=request.user, api_key=key, grace_seconds=form.cleaned_data["grace_seconds"]
            )
        except (ValidationError, Conflict) as exc:
            add_service_errors(form, exc)
        else:
            return _issued(request, issued, "rotated")
    return render(request, "console/key_rotate.html", {"key": key, "form": form})
