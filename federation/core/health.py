"""Health endpoints of the control plane, for load balancers and Kubernetes probes.

``/healthz`` (liveness): the process answers; it reads nothing, so a database outage does not
get every web process restarted. ``/readyz`` (readiness): this process reaches its database;
503 while it does not, so traffic goes to the processes that can serve it.
"""

from __future__ import annotations

from django.db import DatabaseError, connection
from django.http import HttpRequest, JsonResponse
from django.views.decorators.http import require_safe


@require_safe
def healthz(request: HttpRequest) -> JsonResponse:
    return JsonResponse({"status": "ok"})


@require_safe
def readyz(request: HttpRequest) -> JsonResponse:
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
    except DatabaseError as exc:
        return JsonResponse({"status": "unavailable", "database": type(exc).__name__}, status=503)
    return JsonResponse({"status": "ok"})
