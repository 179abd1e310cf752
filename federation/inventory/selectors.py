"""Reads of the fleet, shaped for their callers: every list loads its relations up front so
listing N rows costs a constant number of queries."""

from __future__ import annotations

from typing import Any

from django.db.models import F, IntegerField, Q, QuerySet, Sum, Value
from django.db.models.functions import Coalesce

from federation.core.roles import TENANT_VIEWER, is_staff_role, role_of, tenant_id_of
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


def region_list() -> QuerySet[Region]:
    return Region.objects.all()


def region_link_list() -> QuerySet[RegionLink]:
    return RegionLink.objects.select_related("source", "target")


def accelerator_type_list() -> QuerySet[AcceleratorType]:
    return AcceleratorType.objects.all()


def pool_list() -> QuerySet[GPUPool]:
    """Pools with ``used_gpus`` (desired replicas x TP over their deployments) and
    ``free_gpus`` annotated, so capacity is listed and filtered in one query."""
    used = Coalesce(
        Sum(
            F("deployments__desired_replicas") * F("deployments__tensor_parallel_size"),
            output_field=IntegerField(),
        ),
        Value(0),
        output_field=IntegerField(),
    )
    return (
        GPUPool.objects.select_related("region", "accelerator")
        .annotate(used_gpus=used)
        .annotate(free_gpus=F("gpus_per_node") * F("node_count") - F("used_gpus"))
        # Meta.ordering is ignored by aggregating queries: order explicitly for stable pages.
        .order_by("region__code", "name")
    )


def model_list() -> QuerySet[LanguageModel]:
    return LanguageModel.objects.all()


def adapter_list() -> QuerySet[LoraAdapter]:
    return LoraAdapter.objects.select_related("base_model", "owner")


def adapters_visible_to(*, user: Any) -> QuerySet[LoraAdapter]:
    """Every adapter for staff; for a tenant viewer the public ones and its tenant's own (any
    other is absent: 404, as if it did not exist); none for anyone else."""
    qs = adapter_list()
    if is_staff_role(user):
        return qs
    if role_of(user) == TENANT_VIEWER:
        return qs.filter(Q(owner__isnull=True) | Q(owner_id=tenant_id_of(user)))
    return qs.none()


def deployment_list() -> QuerySet[Deployment]:
    return Deployment.objects.select_related(
        "model", "pool__region", "pool__accelerator"
    ).prefetch_related("adapters")


def instance_list() -> QuerySet[Instance]:
    return Instance.objects.select_related("deployment__model", "deployment__pool__region")


def edge_list() -> QuerySet[Edge]:
    return Edge.objects.select_related("region")
