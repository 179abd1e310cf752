"""The audit trail (admins and operators), filterable, and the users (admins only: an
operator runs the fleet but does not manage people)."""

from __future__ import annotations

from datetime import UTC, date, datetime, time, timedelta

from django.core.paginator import Paginator
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render

from console.access import STAFF, console_view
from console.forms import AuditFilterForm
from federation.core.roles import ADMIN
from federation.core.selectors import audit_event_list
from federation.tenancy.selectors import user_list as users

EVENTS_PER_PAGE = 50


def _midnight(day: date) -> datetime:
    return datetime.combine(day, time(0), tzinfo=UTC)


@console_view(*STAFF)
def audit_log(request: HttpRequest) -> HttpResponse:
    form = AuditFilterForm(request.GET)
    events = audit_event_list(user=request.user).select_related(None)
    if form.is_valid():
        data = form.cleaned_data
        if data["actor"]:
            events = events.filter(actor_repr=data["actor"])
        if data["action"]:
            events = events.filter(action=data["action"])
        if data["object_type"]:
            events = events.filter(object_type=data["object_type"])
        if data["since"]:
            events = events.filter(created_at__gte=_midnight(data["since"]))
        if data["until"]:
            events = events.filter(created_at__lt=_midnight(data["until"]) + timedelta(days=1))
    else:
        events = events.none()
    page = Paginator(events, EVENTS_PER_PAGE).get_page(request.GET.get("page"))
    query = request.GET.copy()
    query.pop("page", None)
    return render(
        request, "console/audit.html", {"form": form, "page": page, "query": query.urlencode()}
    )


@console_view(ADMIN)
def user_list(request: HttpRequest) -> HttpResponse:
    return render(request, "console/users.html", {"users": users()})
