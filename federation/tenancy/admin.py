"""Django admin for tenancy. Key hashes are never shown; keys are issued through the API,
which shows the plaintext once, so the admin cannot create or edit key material."""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.http import HttpRequest

from federation.tenancy.models import ApiKey, Membership, Tenant


@admin.register(Tenant)
class TenantAdmin(admin.ModelAdmin):
    list_display = ["slug", "name", "allowed_jurisdictions", "requests_per_minute", "is_active"]
    list_filter = ["is_active"]
    search_fields = ["slug", "name"]
    filter_horizontal = ["allowed_regions"]


@admin.register(ApiKey)
class ApiKeyAdmin(admin.ModelAdmin):
    list_display = ["prefix", "name", "tenant", "expires_at", "revoked_at", "last_used_at"]
    list_filter = ["tenant"]
    search_fields = ["prefix", "name", "tenant__slug"]
    fields = (
        "tenant",
        "name",
        "prefix",
        "scopes",
        "expires_at",
        "revoked_at",
        "previous_key_valid_until",
        "last_used_at",
        "created_by",
        "created_at",
    )
    readonly_fields = fields

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


@admin.register(Membership)
class MembershipAdmin(admin.ModelAdmin):
    list_display = ["user", "role", "tenant"]
    list_filter = ["role", "tenant"]
    search_fields = ["user__username"]
