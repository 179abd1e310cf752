"""The control plane's Prometheus metrics: the families its code updates, the request
middleware, and the ``/metrics`` view.

Two kinds of series, kept apart on purpose:

* counters and histograms (requests, table compiles and publishes, LP solves, rejected usage)
  live in prometheus_client's default registry and count what *this process* did. ``fedinfer
  serve`` is one process (uvicorn with ``--workers 1`` by default; run several behind a load
  balancer and Prometheus scrapes each); the worker exposes the ones it updates on its own
  port (``workers.metrics``).
* gauges that describe the fleet's state (versions behind, heartbeat ages, instance counts,
  budgets, ingestion lag) are read from the database and Redis at scrape time by collectors
  the domains register in :data:`STATE` (``federation.routing.metrics``), so every web
  process answers the same.

Who may read ``/metrics`` (:func:`metrics_allowed`): a staff session (admin or operator), a
request with ``Authorization: Bearer <FEDINFER_METRICS_TOKEN>``, or — only while that setting
is empty — a client on a loopback address (as ``FEDINFER_TRUSTED_PROXIES`` resolves it).
"""

from __future__ import annotations

import hmac
import ipaddress
from collections.abc import Awaitable, Callable, Iterable
from time import perf_counter
from typing import Any

from asgiref.sync import iscoroutinefunction, markcoroutinefunction
from django.conf import settings
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.urls import Resolver404, resolve
from django.views.decorators.http import require_safe
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    REGISTRY,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)

from federation.api.throttles import client_address
from federation.core.roles import is_staff_role

#: Scrape-time collectors of the fleet's state (served by the web's ``/metrics`` only).
STATE = CollectorRegistry(auto_describe=False)

HTTP_REQUESTS = Counter(
    "fedinfer_cp_http_requests",
    "Control-plane HTTP requests answered, by method, URL pattern and status",
    ["method", "route", "status"],
)
HTTP_REQUEST_DURATION = Histogram(
    "fedinfer_cp_http_request_duration_seconds",
    "Control-plane HTTP request duration by URL pattern (long polls included: they wait)",
    ["route"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
)
TABLE_COMPILE = Histogram(
    "fedinfer_cp_table_compile_seconds",
    "One compile-and-publish of the routing tables: fleet read, demand split, every region's "
    "document, the changed versions stored",
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)
TABLE_PUBLISH = Counter(
    "fedinfer_cp_table_publish", "Routing-table versions published, by region", ["region"]
)
DEMAND_SPLIT_SOLVE = Histogram(
    "fedinfer_cp_demand_split_solve_seconds",
    "The demand split's linear programme (HiGHS), one observation per solve",
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 5),
)
HEARTBEAT_WORKERS_CLAMPED = Counter(
    "fedinfer_cp_heartbeat_workers_clamped",
    "Edge heartbeats that claimed more worker processes than the edge's max_workers (the "
    "claim was clamped), by edge",
    ["edge"],
)
USAGE_REJECTED = Counter(
    "fedinfer_cp_usage_rejected",
    "Usage documents refused at ingestion (kept on the rejected stream or answered to the edge)",
)


def tables_published(regions: Iterable[str]) -> None:
    """Count published versions (called once their transaction committed)."""
    for region in regions:
        TABLE_PUBLISH.labels(region).inc()


#: The route label of a request no URL pattern matches (a 404): raw paths never become labels.
UNMATCHED_ROUTE = "<unmatched>"


def _route(request: HttpRequest) -> str:
    match = request.resolver_match
    if match is None:  # answered before URL resolution (a 413), or nothing matched
        try:
            match = resolve(request.path_info)
        except Resolver404:
            return UNMATCHED_ROUTE
    return match.route or UNMATCHED_ROUTE


def _observe(request: HttpRequest, response: HttpResponse, seconds: float) -> None:
    route = _route(request)
    HTTP_REQUESTS.labels(request.method or "", route, str(response.status_code)).inc()
    HTTP_REQUEST_DURATION.labels(route).observe(seconds)


class RequestMetricsMiddleware:
    """Counts and times every request by its URL pattern; sync or async like the chain it
    wraps, so the long poll's async view stays async."""

    sync_capable = True
    async_capable = True

    def __init__(self, get_response: Callable[[HttpRequest], Any]) -> None:
        self.get_response = get_response
        self.is_async = iscoroutinefunction(get_response)
        if self.is_async:
            markcoroutinefunction(self)

    def __call__(self, request: HttpRequest) -> Any:
        if self.is_async:
            return self._acall(request)
        started = perf_counter()
        response = self.get_response(request)
        _observe(request, response, perf_counter() - started)
        return response

    async def _acall(self, request: HttpRequest) -> HttpResponse:
        started = perf_counter()
        get_response: Callable[[HttpRequest], Awaitable[HttpResponse]] = self.get_response
        response = await get_response(request)
        _observe(request, response, perf_counter() - started)
        return response


def _bearer(request: HttpRequest) -> str | None:
    scheme, _, token = str(request.META.get("HTTP_AUTHORIZATION", "")).partition(" ")
    return token.strip() if scheme.lower() == "bearer" else None


def _loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def metrics_allowed(request: HttpRequest) -> bool:
    """The access rule of ``/metrics`` (module docstring)."""
    if is_staff_role(getattr(request, "user", None)):
        return True
    token: str = settings.FEDINFER_METRICS_TOKEN
    if token:
        offered = _bearer(request)
        return offered is not None and hmac.compare_digest(offered.encode(), token.encode())
    return _loopback(client_address(request))


@require_safe
def metrics_view(request: HttpRequest) -> HttpResponse:
    """``GET /metrics``: this process's counters and histograms, then the fleet's state."""
    if not metrics_allowed(request):
        response = JsonResponse(
            {
                "detail": "Metrics are served to staff sessions, to the bearer token "
                "FEDINFER_METRICS_TOKEN, or (without a token) to loopback clients.",
                "code": "metrics_forbidden",
            },
            status=403,
        )
        if settings.FEDINFER_METRICS_TOKEN:
            response["WWW-Authenticate"] = 'Bearer realm="metrics"'
        return response
    body = generate_latest(REGISTRY) + generate_latest(STATE)
    return HttpResponse(body, content_type=CONTENT_TYPE_LATEST)
