"""Writes to GPU pools: every change is rechecked against the deployments placed on them."""

from __future__ import annotations

from collections.abc import Mapping
from decimal import Decimal
from typing import Any

from django.core.exceptions import NON_FIELD_ERRORS
from django.db import transaction
from django.utils import timezone

from federation.core.audit import Actor, audit_record
from federation.core.errors import Conflict
from federation.core.services import Errors, model_apply, model_lock, model_save, model_validate
from federation.inventory.models import (
    AcceleratorType,
    Deployment,
    GPUPool,
    PoolRevision,
    Region,
)
from federation.inventory.services.fit_checks import (
    deployments_with_context,
    pool_spec,
    recheck_deployments,
)

POOL_UPDATABLE = (
    "name",
    "accelerator",
    "gpus_per_node",
    "node_count",
    "interconnect",
    "rdma",
    "price_per_gpu_hour",
    "capacity_type",
    "gpu_memory_utilization",
    "provisioner",
)


#: Fields a pool-hour's cost depends on: a change to one starts a new revision.
_COSTED = frozenset({"name", "gpus_per_node", "node_count", "price_per_gpu_hour"})


def _pool_key(pool: GPUPool) -> str:
    return f"{pool.region.code}/{pool.name}"


def _revise(pool: GPUPool, *, gpus: int, key: str | None = None) -> None:
    """The pool has ``gpus`` GPUs at its price from now on (under ``key``, else its own)."""
    PoolRevision.objects.create(
        pool=key or _pool_key(pool),
        effective_from=timezone.now(),
        gpus=gpus,
        price_per_gpu_hour=pool.price_per_gpu_hour,
    )


def _pool_errors(pool: GPUPool) -> Errors:
    if pool.interconnect == GPUPool.Interconnect.NVLINK and not pool.accelerator.supports_nvlink:
        return {
            "interconnect": [
                f"{pool.accelerator.name} has no NVLink; use '{GPUPool.Interconnect.PCIE}'."
            ]
        }
    return {}


@transaction.atomic
def pool_create(
    *,
    actor: Actor,
    region: Region,
    name: str,
    accelerator: AcceleratorType,
    gpus_per_node: int,
    node_count: int,
    interconnect: str,
    price_per_gpu_hour: Decimal,
    capacity_type: str,
    rdma: bool = False,
    gpu_memory_utilization: float = 0.9,
    provisioner: str = GPUPool.Provisioner.STATIC,
) -> GPUPool:
    pool = GPUPool(
        region=region,
        name=name,
        accelerator=accelerator,
        gpus_per_node=gpus_per_node,
        node_count=node_count,
        interconnect=interconnect,
        rdma=rdma,
        price_per_gpu_hour=price_per_gpu_hour,
        capacity_type=capacity_type,
        gpu_memory_utilization=gpu_memory_utilization,
        provisioner=provisioner,
    )
    model_validate(pool, extra=_pool_errors(pool))
    model_save(pool)
    _revise(pool, gpus=pool.total_gpus)
    audit_record(actor=actor, action="pool.create", obj=pool)
    return pool


@transaction.atomic
def pool_update(*, actor: Actor, pool: GPUPool, data: Mapping[str, Any]) -> GPUPool:
    """Refuses a change that would break a deployment on the pool (memory, TP, capacity)."""
    pool = locked_pool(pool)
    before = pool_spec(pool)
    old_key = _pool_key(pool)
    diff = model_apply(pool, data, updatable=POOL_UPDATABLE)
    errors = _pool_errors(pool)
    broken = recheck_deployments(
        deployments_with_context(Deployment.objects.filter(pool=pool)),
        before=(None, before),
        after=(None, pool_spec(pool)),
    )
    if broken:
        errors[NON_FIELD_ERRORS] = broken
    model_validate(pool, extra=errors)
    model_save(pool)
    if _COSTED & set(diff):
        if _pool_key(pool) != old_key:  # renamed: its old name's GPUs are gone
            _revise(pool, gpus=0, key=old_key)
        _revise(pool, gpus=pool.total_gpus)
    if diff:
        audit_record(actor=actor, action="pool.update", obj=pool, changes=diff)
    return pool


@transaction.atomic
def pool_delete(*, actor: Actor, pool: GPUPool) -> None:
    audit_record(actor=actor, action="pool.delete", obj=pool)
    _revise(pool, gpus=0)
    pool.delete()


def _set_pool_status(*, actor: Actor, pool: GPUPool, status: str, action: str) -> GPUPool:
    pool = model_lock(pool)
    if pool.status != status:
        diff = model_apply(pool, {"status": status}, updatable=("status",))
        pool.save(update_fields=["status", "updated_at"])
        audit_record(actor=actor, action=action, obj=pool, changes=diff)
    return pool


@transaction.atomic
def pool_cordon(*, actor: Actor, pool: GPUPool) -> GPUPool:
    """No new deployments or replicas on the pool; running instances keep serving.
    Idempotent."""
    return _set_pool_status(
        actor=actor, pool=pool, status=GPUPool.Status.CORDONED, action="pool.cordon"
    )


@transaction.atomic
def pool_uncordon(*, actor: Actor, pool: GPUPool) -> GPUPool:
    return _set_pool_status(
        actor=actor, pool=pool, status=GPUPool.Status.ACTIVE, action="pool.uncordon"
    )


def locked_pool(pool: GPUPool) -> GPUPool:
    """Lock the pool row: capacity checks of concurrent deployment writes then serialize."""
    return (
        GPUPool.objects.select_related("region", "accelerator").select_for_update().get(pk=pool.pk)
    )


def pool_accepts_placements_check(pool: GPUPool) -> None:
    """New deployments and replicas go only to an active pool in an active region."""
    if pool.status != GPUPool.Status.ACTIVE:
        raise Conflict(
            f"Pool {pool.region.code}/{pool.name} is {pool.status}: it takes no new replicas; "
            f"uncordon it first.",
            code="pool_cordoned",
        )
    if pool.region.status != Region.Status.ACTIVE:
        raise Conflict(
            f"Region {pool.region.code} is {pool.region.status}: it takes no new replicas; "
            f"restore it first.",
            code="region_not_active",
        )
