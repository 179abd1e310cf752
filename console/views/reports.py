"""Usage and cost over time, charted and exported as CSV, from the metering selectors that
back ``/api/v1/usage/`` and ``/api/v1/costs/``. A tenant viewer's usage report is its own
tenant's, whatever it asks; pool costs are for admins and operators."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from datetime import date
from decimal import Decimal
from functools import partial
from typing import Any
from urllib.parse import urlencode

from django.forms import Form
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render
from django.utils import timezone

from console.access import EVERYONE, STAFF, console_view
from console.charts import MAX_SERIES, chart_series
from console.forms import STAFF_METRICS, RangeForm, UsageForm
from federation.core.csv_export import csv_attachment
from federation.core.roles import is_staff_role
from federation.metering.models import DIMENSIONS, Dimension
from federation.metering.selectors import (
    UsageQuery,
    pool_cost_report,
    usage_report,
    usage_report_by_group_and_bucket,
)
from federation.tenancy.selectors import tenant_list


def _text(value: Any) -> Any:
    if isinstance(value, date):
        return value.isoformat()
    return str(value) if isinstance(value, Decimal) else value


def _csv(rows: Sequence[Mapping[str, Any]], name: str) -> HttpResponse:
    """Exact decimals as text, days and hours in ISO 8601 (as the API's CSV)."""
    return csv_attachment(({k: _text(v) for k, v in row.items()} for row in rows), name)


def _query(form: Form) -> str:
    """The report's query string (defaults included), for its CSV link."""
    return urlencode({k: v for k in form.fields if (v := form.data.get(k)) not in (None, "")})


def _totals(
    rows: Sequence[Mapping[str, Any]], key: str, metrics: Sequence[str]
) -> list[dict[str, Any]]:
    acc: dict[str, dict[str, Any]] = {}
    for row in rows:
        label = str(row[key] or "—")
        into = acc.setdefault(label, {key: label, **{m: 0 for m in metrics}})
        for m in metrics:
            into[m] += row.get(m) or 0
    return sorted(acc.values(), key=lambda r: str(r[key]))


#: Rows of the totals table; the CSV has them all.
TOTALS_SHOWN = 50
#: Dimensions whose groups grow with the customers (thousands), not with the fleet (tens).
MANY_GROUPS = frozenset({"tenant"})


def _usage_view(
    query: Callable[..., UsageQuery],
    filters: dict[Dimension, list[str]],
    data: dict[str, Any],
    metrics: list[str],
) -> tuple[dict[str, Any], list[dict[str, Any]], int]:
    """(chart, the first :data:`TOTALS_SHOWN` totals by group, biggest first, the number of
    groups). A dimension of the fleet is read in one pass by bucket and group, with the sums
    shown only. Tenants are summed by the database three times — the charted metric by tenant
    (to rank them) and by bucket (the chart's "other") in one pass, every metric of the
    tenants listed, the biggest few by bucket — so a month over 5,000 tenants reads its rows
    once for one column and a few thousand rows back, instead of one per tenant and day."""
    group, bucket, metric = data["group_by"], data["bucket"], data["metric"]
    if group not in MANY_GROUPS:
        rows = usage_report(query(group_by=[group], bucket=bucket, filters=filters, only=metrics))
        chart = chart_series(rows, time_key=bucket, group_key=group, metric=metric)
        totals = _totals(rows, group, metrics)
        totals.sort(key=lambda r: (-float(r.get(metric, 0)), str(r[group])))
        return chart, totals[:TOTALS_SHOWN], len(totals)
    # Ordered by group; the chart takes the biggest in that order, the table by label.
    ranked, overall = usage_report_by_group_and_bucket(
        query(bucket=bucket, filters=filters, only=[metric]), group
    )
    size = {r[group]: float(r[metric] or 0) for r in ranked}
    listed = sorted(size, key=lambda g: (-size[g], str(g or "—")))[:TOTALS_SHOWN]
    rows = usage_report(query(group_by=[group], filters={**filters, group: listed}, only=metrics))
    full = {r[group]: r for r in rows}
    totals = [{group: g or "—", **{m: full[g].get(m) or 0 for m in metrics}} for g in listed]
    shown = sorted(size, key=lambda g: -size[g])[:MAX_SERIES]
    chart = chart_series(
        usage_report(
            query(group_by=[group], bucket=bucket, filters={**filters, group: shown}, only=[metric])
        ),
        time_key=bucket,
        group_key=group,
        metric=metric,
        overall=overall,
        hidden=len(size) - len(shown),
    )
    return chart, totals, len(size)


@console_view(*EVERYONE)
def usage(request: HttpRequest) -> HttpResponse:
    staff = is_staff_role(request.user)
    today = timezone.now().date()
    form = UsageForm(request.GET or UsageForm.defaults(today), staff=staff)
    context: dict[str, Any] = {"form": form, "staff": staff}
    if form.is_valid():
        data = form.cleaned_data
        filters: dict[Dimension, list[str]] = {d: [data[d]] for d in DIMENSIONS if data.get(d)}
        if not staff:
            own = tenant_list(user=request.user).get()  # a viewer sees its tenant only
            filters["tenant"] = [own.slug]
        query = partial(UsageQuery, data["start_at"], data["end_at"], with_cost=staff)
        if request.GET.get("output") == "csv":
            rows = usage_report(
                query(group_by=[data["group_by"]], bucket=data["bucket"], filters=filters)
            )
            return _csv(rows, f"usage-{data['start']}-{data['end']}")
        metrics = ["requests", "prompt_tokens", "completion_tokens", "price_usd"]
        if staff:
            metrics += ["cost_usd", "margin_usd"]
        if data["metric"] not in metrics:
            metrics.append(data["metric"])  # the charted one is in the table too
        chart, totals, groups = _usage_view(query, filters, data, metrics)
        context |= {
            "chart": chart,
            "totals": totals,
            "more": groups - len(totals),
            "metrics": metrics,
            "group_by": data["group_by"],
            "metric_label": dict(STAFF_METRICS)[data["metric"]],
            "query": _query(form),
        }
    return render(request, "console/usage.html", context)


@console_view(*STAFF)
def costs(request: HttpRequest) -> HttpResponse:
    """Each pool's cost and where it went (allocated to requests, idle, warm idle, re-prefill
    of continued streams)."""
    today = timezone.now().date()
    form = RangeForm(request.GET or RangeForm.defaults(today))
    context: dict[str, Any] = {"form": form}
    if form.is_valid():
        data = form.cleaned_data
        rows = pool_cost_report(start=data["start_at"], end=data["end_at"], bucket=data["bucket"])
        if request.GET.get("output") == "csv":
            return _csv(rows, f"costs-{data['start']}-{data['end']}")
        metrics = [
            "gpu_hours",
            "cost_usd",
            "allocated_usd",
            "idle_usd",
            "warm_idle_usd",
            "reprefill_usd",
        ]
        context |= {
            "chart": chart_series(
                rows, time_key=data["bucket"], group_key="pool", metric="cost_usd"
            ),
            "totals": _totals(rows, "pool", metrics),
            "metrics": metrics,
            "query": _query(form),
        }
    return render(request, "console/costs.html", context)
