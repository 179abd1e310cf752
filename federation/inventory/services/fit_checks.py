"""The fleet as the pure fit rules see it (``federation.inventory.fit``): specs built from
rows, and the checks services run against the rows around a change."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from django.db import models

from federation.core.services import Errors
from federation.inventory import fit
from federation.inventory.models import Deployment, GPUPool, LanguageModel, LoraAdapter


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


def adapter_specs(adapters: Iterable[LoraAdapter]) -> tuple[fit.AdapterSpec, ...]:
    return tuple(fit.AdapterSpec(a.name, a.base_model.name) for a in adapters)


def deployment_spec(dep: Deployment, adapters: Iterable[LoraAdapter]) -> fit.DeploymentSpec:
    return fit.DeploymentSpec(
        tensor_parallel_size=dep.tensor_parallel_size,
        min_replicas=dep.min_replicas,
        desired_replicas=dep.desired_replicas,
        max_replicas=dep.max_replicas,
        engine_args=dep.engine_args,
        adapters=adapter_specs(adapters),
    )


def other_demands(pool: GPUPool, *, exclude: Deployment | None = None) -> list[tuple[int, int]]:
    qs = Deployment.objects.filter(pool=pool)
    if exclude is not None and exclude.pk is not None:
        qs = qs.exclude(pk=exclude.pk)
    return list(qs.values_list("tensor_parallel_size", "desired_replicas"))


def problems_as_errors(problems: Sequence[fit.Problem]) -> Errors:
    errors: Errors = {}
    for p in problems:
        errors.setdefault(p.field, []).append(p.message)
    return errors


def recheck_deployments(
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
        spec = deployment_spec(dep, ())
        demands = other_demands(dep.pool, exclude=dep)
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


def deployments_with_context(qs: models.QuerySet[Deployment]) -> models.QuerySet[Deployment]:
    return qs.select_related("model", "pool__region", "pool__accelerator")
