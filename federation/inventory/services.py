"""Every write to the fleet. Views, tasks and commands call these, never ``save()`` directly.

Each service runs in one transaction: it validates (field rules through ``full_clean``,
cross-row rules through ``fit``), saves, and records an audit event, so a refused request
leaves nothing behind. Bad input raises ``ValidationError({field: [message]})`` (HTTP 400), a
state conflict raises ``Conflict`` (409), deleting something still referenced raises
``ProtectedError`` (409).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from decimal import Decimal
from typing import Any, TypeVar

from django.core.exceptions import NON_FIELD_ERRORS, ValidationError
from django.db import IntegrityError, models, transaction
from django.utils import timezone

from federation.core.audit import Actor, audit_record, model_diff
from federation.core.errors import Conflict
from federation.inventory import fit, lifecycle
from federation.inventory.models import (
    AcceleratorType,
    Deployment,
    Edge,
    GPUPool,
    Instance,
    LanguageModel,
    LoraAdapter,
    Region,
    RegionLink,
)

M = TypeVar("M", bound=models.Model)
Errors = dict[str, list[str]]


# --- helpers -------------------------------------------------------------------------------


def _merge(errors: Errors, more: Mapping[str, Iterable[str]]) -> Errors:
    for key, messages in more.items():
        errors.setdefault(key, []).extend(messages)
    return errors


def _clean_errors(obj: models.Model, *, validate_constraints: bool = True) -> Errors:
    try:
        obj.full_clean(validate_constraints=validate_constraints)
    except ValidationError as exc:
        return {key: [str(m) for m in msgs] for key, msgs in exc.message_dict.items()}
    return {}


def _validate_and_save(obj: M, *, extra: Errors | None = None) -> M:
    """``full_clean`` plus the caller's cross-row errors; raise them all at once or save."""
    errors = _merge(_clean_errors(obj, validate_constraints=not extra), extra or {})
    if errors:
        raise ValidationError(errors)
    try:
        with transaction.atomic():
            obj.save()
    except IntegrityError as exc:
        # full_clean saw no clash, so a concurrent request won the race for a unique value.
        raise Conflict(
            f"{obj._meta.verbose_name} conflicts with a concurrent change; retry.",
            code="concurrent_change",
        ) from exc
    return obj


def _apply(obj: models.Model, data: Mapping[str, Any], allowed: Iterable[str]) -> dict[str, Any]:
    """Set ``data`` on ``obj``; return the audit diff. Unknown keys are a programming error."""
    unknown = set(data) - set(allowed)
    if unknown:
        raise TypeError(f"cannot update {sorted(unknown)} of {obj._meta.label}")
    diff = model_diff(obj, dict(data))
    for name, value in data.items():
        setattr(obj, name, value)
    return diff


def _lock(obj: M) -> M:
    """Re-read ``obj`` under a row lock so concurrent writers queue instead of racing."""
    return type(obj)._default_manager.select_for_update().get(pk=obj.pk)


# --- conversions to the pure fit specs ----------------------------------------------------


def pool_spec(pool: GPUPool) -> fit.PoolSpec:
    return fit.PoolSpec(
        name=f"{pool.region.code}/{pool.name}",
        accelerator_name=pool.accelerator.name,
        accelerator_memory_gib=float(pool.accelerator.memory_gib),
        gpus_per_node=pool.gpus_per_node,
        node_count=pool.node_count,
        interconnect=pool.interconnect,
        rdma=pool.rdma,
        gpu_memory_utilization=pool.gpu_memory_utilization,
    )


def model_spec(model: LanguageModel) -> fit.ModelSpec:
    return fit.ModelSpec(
        name=model.name,
        weight_size_gib=float(model.weight_size_gib),
        max_context_tokens=model.max_context_tokens,
        num_layers=model.num_layers,
        num_attention_heads=model.num_attention_heads,
        num_kv_heads=model.num_kv_heads,
        head_dim=model.head_dim,
    )


def _adapter_specs(adapters: Iterable[LoraAdapter]) -> tuple[fit.AdapterSpec, ...]:
    return tuple(fit.AdapterSpec(a.name, a.base_model.name) for a in adapters)


def _deployment_spec(dep: Deployment, adapters: Iterable[LoraAdapter]) -> fit.DeploymentSpec:
    return fit.DeploymentSpec(
        tensor_parallel_size=dep.tensor_parallel_size,
        min_replicas=dep.min_replicas,
        desired_replicas=dep.desired_replicas,
        max_replicas=dep.max_replicas,
        engine_args=dep.engine_args,
        adapters=_adapter_specs(adapters),
    )


def _other_demands(pool: GPUPool, *, exclude: Deployment | None = None) -> list[tuple[int, int]]:
    qs = Deployment.objects.filter(pool=pool)
    if exclude is not None and exclude.pk is not None:
        qs = qs.exclude(pk=exclude.pk)
    return list(qs.values_list("tensor_parallel_size", "desired_replicas"))


def _problems_as_errors(problems: Sequence[fit.Problem]) -> Errors:
    errors: Errors = {}
    for p in problems:
        errors.setdefault(p.field, []).append(p.message)
    return errors


def _recheck_deployments(
    deployments: Iterable[Deployment],
    *,
    before: tuple[fit.ModelSpec | None, fit.PoolSpec | None],
    after: tuple[fit.ModelSpec | None, fit.PoolSpec | None],
) -> list[str]:
    """Problems a model or pool change would newly cause to existing deployments.

    Problems the deployment already had are not blamed on this change.
    """
    messages: list[str] = []
    for dep in deployments:
        # Adapters are left out: a model or pool change cannot move them to another model,
        # and renaming the model would otherwise look like a mismatch.
        spec = _deployment_spec(dep, ())
        demands = _other_demands(dep.pool, exclude=dep)
        current = (model_spec(dep.model), pool_spec(dep.pool))
        old_model, old_pool = (before[0] or current[0], before[1] or current[1])
        new_model, new_pool = (after[0] or current[0], after[1] or current[1])
        old = fit.check_deployment_fit(spec, model=old_model, pool=old_pool, other_demands=demands)
        new = fit.check_deployment_fit(spec, model=new_model, pool=new_pool, other_demands=demands)
        label = f"{dep.model.name} on {dep.pool.region.code}/{dep.pool.name} ({dep.role})"
        messages += [
            f"deployment {label} would no longer fit: {p.message}" for p in new if p not in old
        ]
    return messages


def _deployments_with_context(qs: models.QuerySet[Deployment]) -> models.QuerySet[Deployment]:
    return qs.select_related("model", "pool__region", "pool__accelerator")


# --- regions -------------------------------------------------------------------------------

REGION_UPDATABLE = ("name", "provider", "latitude", "longitude", "jurisdiction", "status")


@transaction.atomic
def region_create(
    *,
    actor: Actor,
    code: str,
    name: str,
    provider: str,
    latitude: float,
    longitude: float,
    jurisdiction: str,
) -> Region:
    region = _validate_and_save(
        Region(
            code=code,
            name=name,
            provider=provider,
            latitude=latitude,
            longitude=longitude,
            jurisdiction=jurisdiction,
        )
    )
    audit_record(actor=actor, action="region.create", obj=region)
    return region


@transaction.atomic
def region_update(*, actor: Actor, region: Region, data: Mapping[str, Any]) -> Region:
    """Update fields; ``status`` may move between active and cordoned here, while evacuation
    has its own services because it also drains instances."""
    region = _lock(region)
    new_status = data.get("status", region.status)
    if new_status != region.status and Region.Status.EVACUATED in (new_status, region.status):
        raise Conflict(
            "Use the evacuate and restore actions to move a region in or out of 'evacuated'.",
            code="use_action",
        )
    diff = _apply(region, data, REGION_UPDATABLE)
    _validate_and_save(region)
    if diff:
        audit_record(actor=actor, action="region.update", obj=region, changes=diff)
    return region


@transaction.atomic
def region_delete(*, actor: Actor, region: Region) -> None:
    """Refused while tenants restrict their residency to the region: dropping it from their
    allow-list would silently widen it to every region."""
    region = _lock(region)
    tenants = list(region.tenants.values_list("slug", flat=True)[:10])
    if tenants:
        raise Conflict(
            f"Cannot delete region {region.code}: the residency policy of tenants "
            f"{', '.join(tenants)} names it.",
            code="protected",
        )
    audit_record(actor=actor, action="region.delete", obj=region)
    region.delete()


@transaction.atomic
def region_evacuate(*, actor: Actor, region: Region) -> Region:
    """Take a region out of traffic: mark it evacuated and drain its ready instances.
    Idempotent."""
    region = _lock(region)
    if region.status == Region.Status.EVACUATED:
        return region
    old = region.status
    region.status = Region.Status.EVACUATED
    region.save(update_fields=["status", "updated_at"])
    drained = [
        _transition(
            actor=actor,
            instance=inst,
            state=lifecycle.DRAINING,
            reason=Instance.DrainReason.EVACUATION,
        ).name
        for inst in Instance.objects.select_for_update()
        .filter(deployment__pool__region=region, state=lifecycle.READY)
        .order_by("pk")
    ]
    audit_record(
        actor=actor,
        action="region.evacuate",
        obj=region,
        changes={"status": [old, region.status], "drained_instances": drained},
    )
    return region


@transaction.atomic
def region_restore(*, actor: Actor, region: Region) -> Region:
    """Put a region back into traffic; undrain the instances its evacuation drained (those an
    operator drained stay drained). Its traffic returns gradually from ``restored_at`` (the
    routing compiler's ramp), not all at once. Idempotent."""
    region = _lock(region)
    if region.status == Region.Status.ACTIVE:
        return region
    old = region.status
    region.status = Region.Status.ACTIVE
    fields = ["status", "updated_at"]
    if old == Region.Status.EVACUATED:
        # The routing compiler ramps its traffic back from now on (no flip back at once).
        region.restored_at = timezone.now()
        fields.append("restored_at")
    region.save(update_fields=fields)
    restored = [
        _transition(actor=actor, instance=inst, state=lifecycle.READY).name
        for inst in Instance.objects.select_for_update()
        .filter(
            deployment__pool__region=region,
            state=lifecycle.DRAINING,
            drain_reason=Instance.DrainReason.EVACUATION,
        )
        .order_by("pk")
    ]
    audit_record(
        actor=actor,
        action="region.restore",
        obj=region,
        changes={"status": [old, region.status], "undrained_instances": restored},
    )
    return region


_UNSET: Any = object()


@transaction.atomic
def region_link_set(
    *,
    actor: Actor,
    source: Region,
    target: Region,
    rtt_ms: float,
    measured_rtt_ms: float | None = _UNSET,
) -> tuple[RegionLink, bool]:
    """Create or update the configured RTT from ``source`` to ``target``; True if created.
    ``measured_rtt_ms`` is kept unless given."""
    if source.pk == target.pk:
        raise ValidationError(
            {"target": ["A region has no link to itself; its RTT is zero by definition."]}
        )
    link = RegionLink.objects.select_for_update().filter(source=source, target=target).first()
    created = link is None
    if link is None:
        link = RegionLink(source=source, target=target)
    data: dict[str, Any] = {"rtt_ms": rtt_ms}
    if measured_rtt_ms is not _UNSET:
        data["measured_rtt_ms"] = measured_rtt_ms
    diff = _apply(link, data, ("rtt_ms", "measured_rtt_ms"))
    _validate_and_save(link)
    if created:
        audit_record(actor=actor, action="region_link.create", obj=link, changes=diff)
    elif diff:
        audit_record(actor=actor, action="region_link.update", obj=link, changes=diff)
    return link, created


@transaction.atomic
def region_link_update(*, actor: Actor, link: RegionLink, data: Mapping[str, Any]) -> RegionLink:
    link = _lock(link)
    diff = _apply(link, data, ("rtt_ms", "measured_rtt_ms"))
    _validate_and_save(link)
    if diff:
        audit_record(actor=actor, action="region_link.update", obj=link, changes=diff)
    return link


@transaction.atomic
def region_link_delete(*, actor: Actor, link: RegionLink) -> None:
    audit_record(actor=actor, action="region_link.delete", obj=link)
    link.delete()


# --- GPU pools -----------------------------------------------------------------------------

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
    )
    _validate_and_save(pool, extra=_pool_errors(pool))
    audit_record(actor=actor, action="pool.create", obj=pool)
    return pool


@transaction.atomic
def pool_update(*, actor: Actor, pool: GPUPool, data: Mapping[str, Any]) -> GPUPool:
    """Refuses a change that would break a deployment on the pool (memory, TP, capacity)."""
    pool = (
        GPUPool.objects.select_related("region", "accelerator").select_for_update().get(pk=pool.pk)
    )
    before = pool_spec(pool)
    diff = _apply(pool, data, POOL_UPDATABLE)
    errors = _pool_errors(pool)
    broken = _recheck_deployments(
        _deployments_with_context(Deployment.objects.filter(pool=pool)),
        before=(None, before),
        after=(None, pool_spec(pool)),
    )
    if broken:
        errors[NON_FIELD_ERRORS] = broken
    _validate_and_save(pool, extra=errors)
    if diff:
        audit_record(actor=actor, action="pool.update", obj=pool, changes=diff)
    return pool


@transaction.atomic
def pool_delete(*, actor: Actor, pool: GPUPool) -> None:
    audit_record(actor=actor, action="pool.delete", obj=pool)
    pool.delete()


def _set_pool_status(*, actor: Actor, pool: GPUPool, status: str, action: str) -> GPUPool:
    pool = _lock(pool)
    if pool.status != status:
        diff = _apply(pool, {"status": status}, ("status",))
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


def _ensure_pool_accepts_placements(pool: GPUPool) -> None:
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


# --- models and adapters -------------------------------------------------------------------

MODEL_UPDATABLE = (
    "name",
    "family",
    "parameter_count_b",
    "dtype",
    "weight_size_gib",
    "max_context_tokens",
    "num_layers",
    "num_attention_heads",
    "num_kv_heads",
    "head_dim",
)


def _model_errors(model: LanguageModel) -> Errors:
    heads, kv = model.num_attention_heads, model.num_kv_heads
    if isinstance(heads, int) and isinstance(kv, int) and kv >= 1 and heads >= 1:
        if kv > heads:
            return {"num_kv_heads": [f"num_kv_heads {kv} exceeds num_attention_heads {heads}."]}
        if heads % kv:
            return {
                "num_kv_heads": [
                    f"num_attention_heads {heads} must be a multiple of num_kv_heads {kv} "
                    f"(grouped-query attention)."
                ]
            }
    return {}


@transaction.atomic
def model_create(
    *,
    actor: Actor,
    name: str,
    family: str,
    parameter_count_b: Decimal,
    weight_size_gib: float,
    max_context_tokens: int,
    num_layers: int,
    num_attention_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: str = LanguageModel.DType.BF16,
) -> LanguageModel:
    model = LanguageModel(
        name=name,
        family=family,
        parameter_count_b=parameter_count_b,
        dtype=dtype,
        weight_size_gib=weight_size_gib,
        max_context_tokens=max_context_tokens,
        num_layers=num_layers,
        num_attention_heads=num_attention_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
    )
    _validate_and_save(model, extra=_model_errors(model))
    audit_record(actor=actor, action="model.create", obj=model)
    return model


@transaction.atomic
def model_update(*, actor: Actor, model: LanguageModel, data: Mapping[str, Any]) -> LanguageModel:
    """Refuses a change that would break a deployment of the model (memory, heads vs TP)."""
    model = _lock(model)
    before = model_spec(model)
    diff = _apply(model, data, MODEL_UPDATABLE)
    errors = _model_errors(model)
    if not errors and not _clean_errors(model, validate_constraints=False):
        broken = _recheck_deployments(
            _deployments_with_context(Deployment.objects.filter(model=model)),
            before=(before, None),
            after=(model_spec(model), None),
        )
        if broken:
            errors[NON_FIELD_ERRORS] = broken
    _validate_and_save(model, extra=errors)
    if diff:
        audit_record(actor=actor, action="model.update", obj=model, changes=diff)
    return model


@transaction.atomic
def model_delete(*, actor: Actor, model: LanguageModel) -> None:
    audit_record(actor=actor, action="model.delete", obj=model)
    model.delete()


@transaction.atomic
def adapter_create(
    *, actor: Actor, base_model: LanguageModel, name: str, rank: int, source: str
) -> LoraAdapter:
    adapter = _validate_and_save(
        LoraAdapter(base_model=base_model, name=name, rank=rank, source=source)
    )
    audit_record(actor=actor, action="adapter.create", obj=adapter)
    return adapter


@transaction.atomic
def adapter_update(*, actor: Actor, adapter: LoraAdapter, data: Mapping[str, Any]) -> LoraAdapter:
    adapter = _lock(adapter)
    diff = _apply(adapter, data, ("base_model", "name", "rank", "source"))
    errors: Errors = {}
    if "base_model" in diff:
        users = list(adapter.deployments.values_list("pk", flat=True))
        if users:
            errors["base_model"] = [
                f"adapter '{adapter.name}' is attached to deployments {users} of its current "
                f"base model; detach it before moving it to another model."
            ]
    _validate_and_save(adapter, extra=errors)
    if diff:
        audit_record(actor=actor, action="adapter.update", obj=adapter, changes=diff)
    return adapter


@transaction.atomic
def adapter_delete(*, actor: Actor, adapter: LoraAdapter) -> None:
    """Refused while deployments serve the adapter (deleting would silently drop it there)."""
    users = list(adapter.deployments.values_list("pk", flat=True))
    if users:
        raise Conflict(
            f"Cannot delete adapter '{adapter.name}': deployments {users} serve it; detach it "
            f"first.",
            code="protected",
        )
    audit_record(actor=actor, action="adapter.delete", obj=adapter)
    adapter.delete()


# --- deployments ---------------------------------------------------------------------------

DEPLOYMENT_UPDATABLE = (
    "tensor_parallel_size",
    "min_replicas",
    "desired_replicas",
    "max_replicas",
    "engine_args",
)


def _check_fit(dep: Deployment, adapters: Sequence[LoraAdapter]) -> Errors:
    return _problems_as_errors(
        fit.check_deployment_fit(
            _deployment_spec(dep, adapters),
            model=model_spec(dep.model),
            pool=pool_spec(dep.pool),
            other_demands=_other_demands(dep.pool, exclude=dep),
        )
    )


def _locked_pool(pool: GPUPool) -> GPUPool:
    """Lock the pool row: capacity checks of concurrent deployment writes then serialize."""
    return (
        GPUPool.objects.select_related("region", "accelerator").select_for_update().get(pk=pool.pk)
    )


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
    engine_args: dict[str, Any] | None = None,
    adapters: Sequence[LoraAdapter] = (),
) -> Deployment:
    """Place a model on a pool; refused with every violated fit constraint."""
    pool = _locked_pool(pool)
    _ensure_pool_accepts_placements(pool)
    dep = Deployment(
        model=model,
        pool=pool,
        role=role,
        tensor_parallel_size=tensor_parallel_size,
        min_replicas=min_replicas,
        desired_replicas=desired_replicas,
        max_replicas=max_replicas,
        engine_args={} if engine_args is None else engine_args,
    )
    adapters = list(adapters)
    _validate_and_save(dep, extra=_check_fit(dep, adapters))
    dep.adapters.set(adapters)
    audit_record(
        actor=actor,
        action="deployment.create",
        obj=dep,
        changes={"adapters": [a.pk for a in adapters]},
    )
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
            raise ValidationError(_problems_as_errors(problems))
    new_adapters: list[LoraAdapter] | None = (
        list(fields.pop("adapters")) if "adapters" in fields else None
    )
    pool = _locked_pool(deployment.pool)
    dep = Deployment.objects.select_related("model").select_for_update().get(pk=deployment.pk)
    dep.pool = pool
    old_desired = dep.desired_replicas
    diff = _apply(dep, fields, DEPLOYMENT_UPDATABLE)
    if dep.desired_replicas > old_desired:
        _ensure_pool_accepts_placements(pool)
    current = list(dep.adapters.select_related("base_model"))
    adapters = current if new_adapters is None else new_adapters
    _validate_and_save(dep, extra=_check_fit(dep, adapters))
    if new_adapters is not None:
        old_ids, new_ids = sorted(a.pk for a in current), sorted(a.pk for a in new_adapters)
        if old_ids != new_ids:
            dep.adapters.set(new_adapters)
            diff["adapters"] = [old_ids, new_ids]
    if diff:
        audit_record(actor=actor, action="deployment.update", obj=dep, changes=diff)
    return dep


@transaction.atomic
def deployment_delete(*, actor: Actor, deployment: Deployment) -> None:
    audit_record(actor=actor, action="deployment.delete", obj=deployment)
    deployment.delete()


# --- instances -----------------------------------------------------------------------------


def _ensure_room_for_replica(deployment: Deployment) -> None:
    """A new live replica needs an accepting pool and room under ``max_replicas``."""
    dep = (
        Deployment.objects.select_related("pool__region")
        .select_for_update(of=("self",))
        .get(pk=deployment.pk)
    )
    _ensure_pool_accepts_placements(dep.pool)
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
    instance = _validate_and_save(
        Instance(
            deployment=deployment,
            name=name,
            endpoint_url=endpoint_url,
            state=lifecycle.PENDING,
            state_changed_at=timezone.now(),
        )
    )
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
    instance = _lock(instance)
    if "load" in data:
        problem = _load_snapshot_problem(data["load"])
        if problem:
            raise ValidationError({"load": [problem]})
    diff = _apply(instance, data, ("endpoint_url", "last_heartbeat_at", "load"))
    _validate_and_save(instance)
    if diff:
        # Load snapshots change constantly; the audit trail notes that, not their content.
        if "load" in diff:
            diff["load"] = ["…", "…"]
        audit_record(actor=actor, action="instance.update", obj=instance, changes=diff)
    return instance


def _transition(*, actor: Actor, instance: Instance, state: str, reason: str = "") -> Instance:
    """Move a locked instance along a legal transition and record it."""
    lifecycle.check_transition(instance.state, state)
    old = instance.state
    instance.state = state
    instance.state_changed_at = timezone.now()
    instance.drain_reason = reason if state == lifecycle.DRAINING else ""
    instance.save(update_fields=["state", "state_changed_at", "drain_reason", "updated_at"])
    audit_record(
        actor=actor,
        action="instance.transition",
        obj=instance,
        changes={"state": [old, state], **({"reason": reason} if reason else {})},
    )
    return instance


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
def instance_transition(*, actor: Actor, instance: Instance, state: str) -> Instance:
    """Any legal lifecycle move (the provisioner reports loading, warming, ready, failed…).
    Becoming ready is refused in an evacuated region, atomically with evacuations."""
    region = _lock_region_of(instance) if state == lifecycle.READY else None
    instance = _lock(instance)
    lifecycle.check_transition(instance.state, state)
    if region is not None:
        _refuse_ready_in_evacuated(region)
    if state in lifecycle.LIVE_STATES and instance.state not in lifecycle.LIVE_STATES:
        _ensure_room_for_replica(instance.deployment)
    reason = Instance.DrainReason.OPERATOR if state == lifecycle.DRAINING else ""
    return _transition(actor=actor, instance=instance, state=state, reason=reason)


@transaction.atomic
def instance_drain(*, actor: Actor, instance: Instance) -> Instance:
    """Stop routing new requests to a ready instance; in-flight ones finish. Idempotent."""
    instance = _lock(instance)
    if instance.state == lifecycle.DRAINING:
        return instance
    return _transition(
        actor=actor,
        instance=instance,
        state=lifecycle.DRAINING,
        reason=Instance.DrainReason.OPERATOR,
    )


@transaction.atomic
def instance_undrain(*, actor: Actor, instance: Instance) -> Instance:
    """Route to a draining instance again. Idempotent for a ready one."""
    region = _lock_region_of(instance)
    instance = _lock(instance)
    if instance.state == lifecycle.READY:
        return instance
    lifecycle.check_transition(instance.state, lifecycle.READY)
    _refuse_ready_in_evacuated(region)
    return _transition(actor=actor, instance=instance, state=lifecycle.READY)


@transaction.atomic
def instance_delete(*, actor: Actor, instance: Instance) -> None:
    """Only stopped or failed instances: a live one still holds GPUs or serves traffic."""
    instance = _lock(instance)
    if instance.state not in lifecycle.TERMINAL_STATES:
        raise Conflict(
            f"Instance {instance.name} is {instance.state}; stop it before deleting it "
            f"(allowed from '{instance.state}': "
            f"{', '.join(lifecycle.allowed_targets(instance.state))}).",
            code="instance_live",
        )
    audit_record(actor=actor, action="instance.delete", obj=instance)
    instance.delete()


# --- edges ---------------------------------------------------------------------------------


@transaction.atomic
def edge_register(*, actor: Actor, region: Region, name: str, url: str) -> Edge:
    edge = _validate_and_save(Edge(region=region, name=name, url=url))
    audit_record(actor=actor, action="edge.register", obj=edge)
    return edge


@transaction.atomic
def edge_update(*, actor: Actor, edge: Edge, data: Mapping[str, Any]) -> Edge:
    edge = _lock(edge)
    diff = _apply(edge, data, ("url", "last_heartbeat_at", "applied_table_version"))
    _validate_and_save(edge)
    if diff:
        audit_record(actor=actor, action="edge.update", obj=edge, changes=diff)
    return edge


@transaction.atomic
def edge_delete(*, actor: Actor, edge: Edge) -> None:
    audit_record(actor=actor, action="edge.delete", obj=edge)
    edge.delete()
