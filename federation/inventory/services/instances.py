"""Writes to instances (engine replicas): their state moves only along the lifecycle
(``federation.inventory.lifecycle``), and becoming ready is serialised with evacuations."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from typing import Any

from django.core.exceptions import ValidationError
from django.db import transaction
from django.utils import timezone

from federation.core.audit import Actor, audit_record
from federation.core.errors import Conflict
from federation.core.services import model_apply, model_lock, model_save, model_validate
from federation.inventory import lifecycle
from federation.inventory.models import Deployment, Instance, InstanceInterval, Region
from federation.inventory.services.pools import pool_accepts_placements_check
from federation.inventory.speed import decode_tokens_per_s, prefill_tokens_per_s


def _ensure_room_for_replica(deployment: Deployment) -> None:
    """A new live replica needs an accepting pool and room under ``max_replicas``."""
    dep = (
        Deployment.objects.select_related("pool__region")
        .select_for_update(of=("self",))
        .get(pk=deployment.pk)
    )
    pool_accepts_placements_check(dep.pool)
    live = dep.instances.filter(state__in=lifecycle.LIVE_STATES).count()
    if live >= dep.max_replicas:
        raise Conflict(
            f"Deployment {dep.pk} already has {live} live instances and its max_replicas is "
            f"{dep.max_replicas}; raise max_replicas or stop one first.",
            code="max_replicas",
        )


@transaction.atomic
def instance_create(
    *, actor: Actor, deployment: Deployment, name: str, endpoint_url: str
) -> Instance:
    """A new replica starts ``pending``; refused beyond ``max_replicas`` live instances or on
    a cordoned pool or an inactive region."""
    _ensure_room_for_replica(deployment)
    instance = Instance(
        deployment=deployment,
        name=name,
        endpoint_url=endpoint_url,
        state=lifecycle.PENDING,
        state_changed_at=timezone.now(),
    )
    model_validate(instance)
    model_save(instance)
    audit_record(actor=actor, action="instance.create", obj=instance)
    return instance


MAX_LOAD_DEPTH = 8


def _load_snapshot_problem(value: Any) -> str | None:
    """A load snapshot is a small JSON object: bounded nesting (the audit diff and the
    routing compiler walk it recursively) and no NUL characters (PostgreSQL refuses them)."""
    if not isinstance(value, dict):
        return "must be an object."
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > MAX_LOAD_DEPTH:
            return f"must not nest deeper than {MAX_LOAD_DEPTH} levels."
        if isinstance(item, str) and "\x00" in item:
            return "must not contain NUL characters."
        if isinstance(item, dict):
            stack += [(k, depth) for k in item] + [(v, depth + 1) for v in item.values()]
        elif isinstance(item, list):
            stack += [(v, depth + 1) for v in item]
    return None


@transaction.atomic
def instance_update(*, actor: Actor, instance: Instance, data: Mapping[str, Any]) -> Instance:
    """Endpoint, heartbeat and load snapshot; the state changes only by transitions."""
    instance = model_lock(instance)
    if "load" in data:
        problem = _load_snapshot_problem(data["load"])
        if problem:
            raise ValidationError({"load": [problem]})
    diff = model_apply(instance, data, updatable=("endpoint_url", "last_heartbeat_at", "load"))
    model_validate(instance)
    model_save(instance)
    if diff:
        # Load snapshots change constantly; the audit trail notes that, not their content.
        if "load" in diff:
            diff["load"] = ["…", "…"]
        audit_record(actor=actor, action="instance.update", obj=instance, changes=diff)
    return instance


def locked_instance_transition(
    *, actor: Actor, instance: Instance, state: str, reason: str = ""
) -> Instance:
    """Move a locked instance along a legal transition and record it."""
    lifecycle.check_transition(instance.state, state)
    old = instance.state
    instance.state = state
    instance.state_changed_at = at = timezone.now()
    instance.drain_reason = reason if state == lifecycle.DRAINING else ""
    instance.save(update_fields=["state", "state_changed_at", "drain_reason", "updated_at"])
    _record_interval(instance, old, at)
    audit_record(
        actor=actor,
        action="instance.transition",
        obj=instance,
        changes={"state": [old, state], **({"reason": reason} if reason else {})},
    )
    return instance


def _record_interval(instance: Instance, old: str, at: datetime) -> None:
    """Open the instance's GPU interval when it starts holding GPUs, note when it is first
    ready, close it when it lets them go (``InstanceInterval``: what past hours are costed
    with)."""
    holds, held = instance.state in lifecycle.GPU_STATES, old in lifecycle.GPU_STATES
    if holds and not held:
        InstanceInterval.objects.create(name=instance.name, started_at=at, **_cost_facts(instance))
        return
    open_interval = InstanceInterval.objects.filter(instance=instance, ended_at__isnull=True)
    if held and not holds:
        open_interval.update(ended_at=at, end_state=instance.state)
    elif instance.state == lifecycle.READY:
        open_interval.filter(ready_at__isnull=True).update(ready_at=at)


def _cost_facts(instance: Instance) -> dict[str, Any]:
    """What an hour's cost needs of the instance: its pool, GPUs and speeds."""
    dep = Deployment.objects.select_related("pool__region", "pool__accelerator", "model").get(
        pk=instance.deployment_id
    )
    tp, speed = dep.tensor_parallel_size, dep.pool.accelerator.relative_speed
    params_b = float(dep.model.parameter_count_b)
    return {
        "instance": instance,
        "pool": f"{dep.pool.region.code}/{dep.pool.name}",
        "gpus": tp,
        "prefill_tokens_per_s": prefill_tokens_per_s(
            relative_speed=speed, tensor_parallel_size=tp, params_b=params_b
        ),
        "decode_tokens_per_s": decode_tokens_per_s(
            relative_speed=speed, tensor_parallel_size=tp, params_b=params_b
        ),
    }


def _lock_region_of(instance: Instance) -> Region:
    """Lock the row of the instance's region, before the instance is locked.

    Region, then instance: the order ``region_evacuate`` (and the heartbeat) lock them in.
    Holding the region row until commit serialises a transition to ready with an evacuation:
    the evacuation either waits for the transition (and then drains the ready instance) or the
    transition waits for the evacuation (and then is refused). Reading the region without the
    lock let both commit, leaving a ready instance in an evacuated region.
    """
    region_id = (
        Instance.objects.filter(pk=instance.pk)
        .values_list("deployment__pool__region_id", flat=True)
        .get()
    )
    return Region.objects.select_for_update().get(pk=region_id)


def _refuse_ready_in_evacuated(region: Region) -> None:
    if region.status == Region.Status.EVACUATED:
        raise Conflict(
            f"Region {region.code} is evacuated: its instances cannot become ready; restore "
            f"the region first.",
            code="region_evacuated",
        )


@transaction.atomic
def instance_transition(
    *, actor: Actor, instance: Instance, state: str, note: str = ""
) -> Instance:
    """Any legal lifecycle move (the provisioner reports loading, warming, ready, failed…).
    Becoming ready is refused in an evacuated region, atomically with evacuations. ``note``
    (why, e.g. the failed probes) goes into the audit event."""
    region = _lock_region_of(instance) if state == lifecycle.READY else None
    instance = model_lock(instance)
    lifecycle.check_transition(instance.state, state)
    if region is not None:
        _refuse_ready_in_evacuated(region)
    if state in lifecycle.LIVE_STATES and instance.state not in lifecycle.LIVE_STATES:
        _ensure_room_for_replica(instance.deployment)
    reason = Instance.DrainReason.OPERATOR if state == lifecycle.DRAINING else note
    return locked_instance_transition(actor=actor, instance=instance, state=state, reason=reason)


@transaction.atomic
def instance_bring_up(*, actor: Actor, instance: Instance) -> Instance:
    """An engine that is already running (a static instance, the demo's, a benchmark's):
    walked pending → loading → warming → ready in one transaction, each step checked as if
    its provisioner had reported it."""
    for state in (lifecycle.LOADING, lifecycle.WARMING, lifecycle.READY):
        instance = instance_transition(actor=actor, instance=instance, state=state)
    return instance


@transaction.atomic
def instance_drain(
    *, actor: Actor, instance: Instance, reason: str = Instance.DrainReason.OPERATOR
) -> Instance:
    """Stop routing new requests to a ready instance; in-flight ones finish. Idempotent.
    ``reason`` says who may end the drain: the fleet stops only what it scaled down."""
    instance = model_lock(instance)
    if instance.state == lifecycle.DRAINING:
        return instance
    return locked_instance_transition(
        actor=actor, instance=instance, state=lifecycle.DRAINING, reason=reason
    )


@transaction.atomic
def instance_undrain(*, actor: Actor, instance: Instance) -> Instance:
    """Route to a draining instance again. Idempotent for a ready one."""
    region = _lock_region_of(instance)
    instance = model_lock(instance)
    if instance.state == lifecycle.READY:
        return instance
    lifecycle.check_transition(instance.state, lifecycle.READY)
    _refuse_ready_in_evacuated(region)
    return locked_instance_transition(actor=actor, instance=instance, state=lifecycle.READY)


@transaction.atomic
def instance_delete(*, actor: Actor, instance: Instance) -> None:
    """Only stopped or failed instances: a live one still holds GPUs or serves traffic."""
    instance = model_lock(instance)
    if instance.state not in lifecycle.TERMINAL_STATES:
        raise Conflict(
            f"Instance {instance.name} is {instance.state}; stop it before deleting it "
            f"(allowed from '{instance.state}': "
            f"{', '.join(lifecycle.allowed_targets(instance.state))}).",
            code="instance_live",
        )
    audit_record(actor=actor, action="instance.delete", obj=instance)
    instance.delete()
