"""Models and placement: the models x regions matrix, deployments, adapters, recent history."""

from __future__ import annotations

from collections import Counter

from django.db.models import Q
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render

from console.access import STAFF, console_view
from federation.core.selectors import audit_event_list
from federation.inventory import lifecycle
from federation.inventory import selectors as inventory_selectors
from federation.inventory.models import Deployment

#: Audit events of placement, scaling and failover shown under the matrix.
HISTORY_ROWS = 25
#: What the history shows: deployments and instances changing (scaling, placement, their
#: lifecycle), regions evacuated and restored by operators, and whatever the fleet worker
#: does on its own (``fleet.*``: engines started and stopped, automatic failover).
HISTORY = (
    Q(object_type__in=["inventory.deployment", "inventory.instance"])
    | Q(action__in=["region.evacuate", "region.restore"])
    | Q(action__startswith="fleet.")
)


@console_view(*STAFF)
def model_matrix(request: HttpRequest) -> HttpResponse:
    regions = list(inventory_selectors.region_list())
    models = list(inventory_selectors.model_list())
    states: Counter[tuple[int, str]] = Counter(
        inventory_selectors.instance_list().values_list("deployment_id", "state")
    )
    cells: dict[tuple[int, int], list[tuple[Deployment, int, int]]] = {}
    for dep in inventory_selectors.deployment_list():
        live = sum(states[(dep.pk, s)] for s in lifecycle.LIVE_STATES)
        cells.setdefault((dep.model_id, dep.pool.region_id), []).append(
            (dep, states[(dep.pk, lifecycle.READY)], live)
        )
    matrix = [(m, [cells.get((m.pk, r.pk), []) for r in regions]) for m in models]
    history = audit_event_list(user=request.user).filter(HISTORY)[:HISTORY_ROWS]
    context = {
        "regions": regions,
        "matrix": matrix,
        "adapters": inventory_selectors.adapter_list().prefetch_related(
            "deployments__pool__region"
        ),
        "history": history,
    }
    return render(request, "console/models.html", context)
