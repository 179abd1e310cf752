"""What the worker remembers, in the admin: read-only (the worker writes it)."""

from __future__ import annotations

from django.contrib import admin

from federation.core.admin_site import ReadOnlyAdmin
from federation.fleet.models import DeploymentAutoscale, InstanceRuntime, RegionFailover


@admin.register(InstanceRuntime)
class InstanceRuntimeAdmin(ReadOnlyAdmin):
    list_display = ["instance", "provisioner", "failures", "successes", "last_problem"]
    list_select_related = ["instance"]
    list_filter = ["provisioner"]
    search_fields = ["instance__name"]


@admin.register(RegionFailover)
class RegionFailoverAdmin(ReadOnlyAdmin):
    list_display = ["region", "evacuated_at", "reason", "stable_since"]
    list_select_related = ["region"]


@admin.register(DeploymentAutoscale)
class DeploymentAutoscaleAdmin(ReadOnlyAdmin):
    list_display = ["deployment", "utilisation", "reason", "low_since", "changed_at", "observed_at"]
    list_select_related = ["deployment__model", "deployment__pool__region"]
