"""Writes to deployments (models placed on pools), each refused with every violated fit rule."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from django.core.exceptions import ValidationError
from django.db import transaction

from federation.core.audit import Actor, audit_record
from federation.core.roles import ADMIN, role_of
from federation.core.services import Errors, model_apply, model_save, model_validate
from federation.inventory import engine_flags, fit
from federation.inventory.models import Deployment, GPUPool, LanguageModel, LoraAdapter
from federation.inventory.services.fit_checks import (
    deployment_spec,
    model_spec,
    other_demands,
    pool_spec,
    problems_as_errors,
)
from federation.inventory.services.pools import locked_pool, pool_accepts_placements_check

DEPLOYMENT_UPDATABLE = (
    "tensor_parallel_size",
    "min_replicas",
    "desired_replicas",
    "max_replicas",
    "autoscale",
    "scale_to_zero_after_s",
    "engine_args",
)


def _foreign_code_changes(actor: Actor, old: Any, new: Any) -> dict[str, list[Any]]:
    """The admin-only engine flags (code or files the engine would run or read) that ``new``
    sets or changes; refused, naming them, unless ``actor`` is an admin."""
    if not isinstance(new, Mapping):
        return {}  # refused with the fit problems
    changes = engine_flags.admin_only_changes(old, new)
    if changes and role_of(actor) != ADMIN:
        raise ValidationError(
            {
                "engine_args": [
                    f"flag '{name}' makes the engine run or read code or files of your "
                    f"choosing: only an admin may set it"
                    for name in sorted(changes)
                ]
            }
        )
    return changes


def _audit_foreign_code(actor: Actor, dep: Deployment, changes: dict[str, list[Any]]) -> None:
    """An audit event of its own, so that an admin's trust in foreign code can be found."""
    if changes:
        audit_record(actor=actor, action="deployment.engine_foreign_code", obj=dep, changes=changes)


def _check_fit(dep: Deployment, adapters: Sequence[LoraAdapter]) -> Errors:
    errors = problems_as_errors(
        fit.check_deployment_fit(
            deployment_spec(dep, adapters),
            model=model_spec(dep.model),
            pool=pool_spec(dep.pool),
            other_demands=other_demands(dep.pool, exclude=dep),
        )
    )
    zero = _scale_to_zero_problem(dep)
    if zero:
        errors.setdefault("scale_to_zero_after_s", []).append(zero)
    return errors


def _scale_to_zero_problem(dep: Deployment) -> str:
    """Scale to zero is the autoscaler's, down to a minimum of 0, for mixed deployments (a
    P/D pair has two deployments that would have to wake together)."""
    if dep.scale_to_zero_after_s is None:
        return ""
    if not dep.autoscale:
        return "needs autoscale: only the autoscaler scales to zero and back"
    if dep.min_replicas != 0:
        return f"needs min_replicas 0, got {dep.min_replicas}"
    if dep.role != Deployment.Role.MIXED:
        return "only mixed deployments scale to zero"
    return ""


@transaction.atomic
def deployment_create(
    *,
    actor: Actor,
    model: LanguageModel,
    pool: GPUPool,
    tensor_parallel_size: int,
    role: str = Deployment.Role.MIXED,
    min_replicas: int = 1,
    desired_replicas: int = 1,
    max_replicas: int = 1,
    autoscale: bool = False,
    scale_to_zero_after_s: int | None = None,
    engine_args: dict[str, Any] | None = None,
    adapters: Sequence[LoraAdapter] = (),
) -> Deployment:
    """Place a model on a pool; refused with every violated fit constraint."""
    foreign = _foreign_code_changes(actor, {}, engine_args)
    pool = locked_pool(pool)
    pool_accepts_placements_check(pool)
    dep = Deployment(
        model=model,
        pool=pool,
        role=role,
        tensor_parallel_size=tensor_parallel_size,
        min_replicas=min_replicas,
        desired_replicas=desired_replicas,
        max_replicas=max_replicas,
        autoscale=autoscale,
        scale_to_zero_after_s=scale_to_zero_after_s,
        engine_args={} if engine_args is None else engine_args,
    )
    adapters = list(adapters)
    model_validate(dep, extra=_check_fit(dep, adapters))
    model_save(dep)
    dep.adapters.set(adapters)
    audit_record(
        actor=actor,
        action="deployment.create",
        obj=dep,
        changes={"adapters": [a.pk for a in adapters]},
    )
    _audit_foreign_code(actor, dep, foreign)
    return dep


@transaction.atomic
def deployment_update(
    *, actor: Actor, deployment: Deployment, data: Mapping[str, Any]
) -> Deployment:
    """Change TP, replicas, engine flags or adapters; model, pool and role are fixed (create
    another deployment to move a model)."""
    fields = dict(data)
    if "engine_args" in fields:
        # Refuse malformed flags before anything walks them (the audit diff recurses).
        problems = fit.check_engine_args(fields["engine_args"], model=model_spec(deployment.model))
        if problems:
            raise ValidationError(problems_as_errors(problems))
    new_adapters: list[LoraAdapter] | None = (
        list(fields.pop("adapters")) if "adapters" in fields else None
    )
    pool = locked_pool(deployment.pool)
    dep = Deployment.objects.select_related("model").select_for_update().get(pk=deployment.pk)
    dep.pool = pool
    old_desired = dep.desired_replicas
    foreign = _foreign_code_changes(actor, dep.engine_args, fields.get("engine_args", {}))
    diff = model_apply(dep, fields, updatable=DEPLOYMENT_UPDATABLE)
    if dep.desired_replicas > old_desired:
        pool_accepts_placements_check(pool)
    current = list(dep.adapters.select_related("base_model"))
    adapters = current if new_adapters is None else new_adapters
    model_validate(dep, extra=_check_fit(dep, adapters))
    model_save(dep)
    if new_adapters is not None:
        old_ids, new_ids = sorted(a.pk for a in current), sorted(a.pk for a in new_adapters)
        if old_ids != new_ids:
            dep.adapters.set(new_adapters)
            diff["adapters"] = [old_ids, new_ids]
    if diff:
        audit_record(actor=actor, action="deployment.update", obj=dep, changes=diff)
    _audit_foreign_code(actor, dep, foreign)
    return dep


@transaction.atomic
def deployment_delete(*, actor: Actor, deployment: Deployment) -> None:
    audit_record(actor=actor, action="deployment.delete", obj=deployment)
    deployment.delete()
