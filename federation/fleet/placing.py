"""The placement planner's writes: a plan (a dry run: the diff, kept for apply, nothing in the
fleet changes) and its application through the inventory services, audited, once, and only to
the fleet it was computed against; and the worker's scheduled pass over both."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

from django.db import transaction
from django.utils import timezone

from federation.core.audit import Actor, audit_record
from federation.core.errors import Conflict
from federation.fleet import placement, placement_inputs, placement_types
from federation.fleet.locks import PLACEMENT_LOCK_ID, advisory_lock
from federation.fleet.models import PlacementPlan
from federation.inventory import services as inventory
from federation.inventory.models import Deployment, GPUPool, LanguageModel

#: Order of application: what frees GPUs first, so that what needs them fits.
_ORDER = {"remove": 0, "resize": 1, "create": 2}


def _who(actor: Actor) -> str:
    return actor.get_username() if actor is not None and actor.is_authenticated else "system"


def plan_document(plan: placement_types.Plan) -> dict[str, Any]:
    """The plan as the API returns it and ``PlacementPlan.document`` keeps it."""
    changes = [{"action": p.action, **asdict(p)} for p in plan.placements if p.action != "keep"]
    changes.sort(key=lambda c: (_ORDER[c["action"]], c["pool"], c["model"]))
    return {
        "changes": changes,
        "placements": [{"action": p.action, **asdict(p)} for p in plan.placements],
        "unserved": [asdict(u) for u in plan.unserved],
        "cost": {
            "usd_per_hour_before": round(plan.usd_per_hour_before, 4),
            "usd_per_hour_after": round(plan.usd_per_hour_after, 4),
            "gpus_before": plan.gpus_before,
            "gpus_after": plan.gpus_after,
        },
        "solver": {"status": plan.status, "gap": round(plan.gap, 6), "seconds": plan.solve_s},
    }


def placement_plan(
    *,
    actor: Actor,
    override: Iterable[placement_inputs.DemandOverride] | None = None,
    window_hours: int = 3,
    policy: placement_types.PlannerPolicy | None = None,
) -> PlacementPlan:
    """Compute a plan against the fleet as it is now and keep it (nothing else is written)."""
    fingerprint = placement_inputs.fleet_fingerprint()
    data = placement_inputs.placement_input(
        now=timezone.now(), window_hours=window_hours, override=override
    )
    plan = placement.plan_placement(data, policy)
    return PlacementPlan.objects.create(
        created_by=_who(actor), fleet_fingerprint=fingerprint, document=plan_document(plan)
    )


@transaction.atomic
def placement_apply(*, actor: Actor, plan: PlacementPlan) -> tuple[PlacementPlan, bool]:
    """Apply a plan's changes; (the plan, whether this call applied it). Applying it again
    does nothing (idempotent); applying it to a fleet that changed since is refused (409)."""
    plan = PlacementPlan.objects.select_for_update().get(pk=plan.pk)
    if plan.applied_at is not None:
        return plan, False
    if placement_inputs.fleet_fingerprint() != plan.fleet_fingerprint:
        raise Conflict(
            "The fleet changed since this plan was made; make a new plan.", code="fleet_changed"
        )
    for change in plan.document["changes"]:
        _apply_change(actor, change)
    plan.applied_at = timezone.now()
    plan.applied_by = _who(actor)
    plan.save(update_fields=["applied_at", "applied_by"])
    audit_record(
        actor=actor,
        action="fleet.placement.apply",
        obj=plan,
        changes={"changes": plan.document["changes"], "cost": plan.document["cost"]},
    )
    return plan, True


def _apply_change(actor: Actor, change: dict[str, Any]) -> None:
    region, _, pool_name = change["pool"].partition("/")
    pool = GPUPool.objects.select_related("region", "accelerator").get(
        region__code=region, name=pool_name
    )
    model = LanguageModel.objects.get(name=change["model"])
    after = int(change["after"])
    if change["action"] == "create":
        inventory.deployment_create(
            actor=actor,
            model=model,
            pool=pool,
            tensor_parallel_size=int(change["tensor_parallel_size"]),
            min_replicas=0,
            desired_replicas=after,
            max_replicas=after,
        )
        return
    dep = Deployment.objects.get(model=model, pool=pool, role=Deployment.Role.MIXED)
    # The planner honours min_replicas; max_replicas follows the plan upwards.
    data = {"desired_replicas": after, "max_replicas": max(dep.max_replicas, after, 1)}
    inventory.deployment_update(actor=actor, deployment=dep, data=data)


def placement_plan_and_apply(
    *,
    actor: Actor,
    override: Iterable[placement_inputs.DemandOverride] | None = None,
    window_hours: int = 3,
) -> PlacementPlan:
    """Recompute and apply at once (a fleet that changes in between is refused, 409)."""
    plan = placement_plan(actor=actor, override=override, window_hours=window_hours)
    applied, _ = placement_apply(actor=actor, plan=plan)
    return applied


#: Unapplied plans of the schedule kept (the newest): a pass every few minutes would otherwise
#: keep one more every time. Applied plans and operators' plans are history, kept.
SCHEDULED_PLANS_KEPT = 100


@dataclass(frozen=True, slots=True)
class ScheduledPass:
    """What one scheduled pass did."""

    plan_id: int
    changes: int
    applied: bool
    outcome: str

    def __str__(self) -> str:
        return f"plan {self.plan_id}: {self.changes} change(s), {self.outcome}"


def placement_scheduled(*, apply: bool, window_hours: int = 3) -> ScheduledPass | None:
    """One scheduled pass of the planner (``FEDINFER_PLACEMENT_*``): plan against the fleet as
    it is and keep the plan; with ``apply``, apply it when it changes something — unless the
    fleet changed since it was planned (an operator or the autoscaler moved first), then it
    stays a plan and the next pass plans again. Audited (``fleet.placement.scheduled``) and
    under a lock, so two workers never plan at once: None when another worker holds it."""
    with advisory_lock(PLACEMENT_LOCK_ID) as held:
        if not held:
            return None
        plan = placement_plan(actor=None, window_hours=window_hours)
        _prune_scheduled_plans()
        changes = len(plan.document["changes"])
        applied, outcome = False, "planned"
        if apply and changes:
            try:
                applied = placement_apply(actor=None, plan=plan)[1]
                outcome = "applied"
            except Conflict:
                outcome = "not applied: the fleet changed since the plan"
        audit_record(
            actor=None,
            action="fleet.placement.scheduled",
            obj=plan,
            changes={
                "mode": "apply" if apply else "plan",
                "outcome": outcome,
                "changes": changes,
                "cost": plan.document["cost"],
            },
        )
        return ScheduledPass(plan.pk, changes, applied, outcome)


def _prune_scheduled_plans() -> None:
    """Delete the schedule's unapplied plans beyond the newest :data:`SCHEDULED_PLANS_KEPT`."""
    unapplied = PlacementPlan.objects.filter(applied_at__isnull=True, created_by=_who(None))
    old = list(unapplied.values_list("pk", flat=True)[SCHEDULED_PLANS_KEPT:])
    if old:
        PlacementPlan.objects.filter(pk__in=old).delete()
