"""Django admin for the fleet: browse, search and filter.

Read-only on purpose: every change to the fleet goes through ``services`` (fit checks, legal
lifecycle transitions, audit events), which the admin's plain ``save()`` would bypass. Change
the fleet through the REST API or the console.
"""

from __future__ import annotations

from django.contrib import admin
from django.db.models import QuerySet
from django.http import HttpRequest

from federation.core.admin_site import ReadOnlyAdmin
from federation.inventory import selectors
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


@admin.register(Region)
class RegionAdmin(ReadOnlyAdmin):
    list_display = ["code", "name", "provider", "jurisdiction", "status"]
    list_filter = ["status", "jurisdiction", "provider"]
    search_fields = ["code", "name"]


@admin.register(RegionLink)
class RegionLinkAdmin(ReadOnlyAdmin):
    list_display = ["source", "target", "rtt_ms", "measured_rtt_ms", "updated_at"]
    list_select_related = ["source", "target"]
    search_fields = ["source__code", "target__code"]


@admin.register(AcceleratorType)
class AcceleratorTypeAdmin(ReadOnlyAdmin):
    list_display = ["name", "vendor", "memory_gib", "relative_speed", "supports_nvlink"]
    list_filter = ["vendor", "supports_nvlink"]
    search_fields = ["name"]


@admin.register(GPUPool)
class GPUPoolAdmin(ReadOnlyAdmin):
    list_display = [
        "name",
        "region",
        "accelerator",
        "gpus_per_node",
        "node_count",
        "interconnect",
        "rdma",
        "capacity_type",
        "price_per_gpu_hour",
        "status",
    ]
    list_filter = ["status", "capacity_type", "interconnect", "accelerator", "region"]
    search_fields = ["name", "region__code"]

    def get_queryset(self, request: HttpRequest) -> QuerySet[GPUPool]:
        return selectors.pool_list()


@admin.register(LanguageModel)
class LanguageModelAdmin(ReadOnlyAdmin):
    list_display = ["name", "family", "parameter_count_b", "dtype", "max_context_tokens"]
    list_filter = ["family", "dtype"]
    search_fields = ["name", "family"]


@admin.register(LoraAdapter)
class LoraAdapterAdmin(ReadOnlyAdmin):
    list_display = ["name", "base_model", "rank", "owner", "source"]
    list_select_related = ["base_model", "owner"]
    list_filter = ["base_model", "owner"]
    search_fields = ["name", "base_model__name"]


@admin.register(Deployment)
class DeploymentAdmin(ReadOnlyAdmin):
    list_display = [
        "id",
        "model",
        "pool",
        "role",
        "tensor_parallel_size",
        "min_replicas",
        "desired_replicas",
        "max_replicas",
    ]
    list_select_related = ["model", "pool__region"]
    list_filter = ["role", "pool__region", "model"]
    search_fields = ["model__name", "pool__name", "pool__region__code"]


@admin.register(Instance)
class InstanceAdmin(ReadOnlyAdmin):
    list_display = [
        "name",
        "deployment",
        "state",
        "drain_reason",
        "endpoint_url",
        "state_changed_at",
        "last_heartbeat_at",
    ]
    list_select_related = ["deployment"]
    list_filter = ["state", "deployment__pool__region"]
    search_fields = ["name", "endpoint_url"]


@admin.register(Edge)
class EdgeAdmin(ReadOnlyAdmin):
    list_display = [
        "name",
        "region",
        "url",
        "last_heartbeat_at",
        "applied_table_version",
        "workers",
        "max_workers",
    ]
    list_select_related = ["region"]
    list_filter = ["region"]
    search_fields = ["name", "url"]
