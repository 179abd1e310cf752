"""Django admin for tenancy.

Key hashes are never shown, and keys cannot be added or edited here: they are issued through
the API, which shows the plaintext once. Tenant and membership edits are validated like the
API's (residency policy, role/tenant pairing) and written to the audit trail.
"""

from __future__ import annotations

from typing import Any

from django import forms
from django.contrib import admin
from django.db.models import Model, QuerySet
from django.http import HttpRequest

from federation.core.admin_site import ReadOnlyAdmin
from federation.core.audit import audit_record
from federation.tenancy.models import ApiKey, AuthToken, Membership, Tenant
from federation.tenancy.services import tenant_residency_errors


def _plain(value: Any) -> Any:
    if isinstance(value, QuerySet):
        return sorted(str(obj) for obj in value)
    if isinstance(value, Model):
        return str(value)
    return value


class AuditedAdmin(admin.ModelAdmin):
    """Records an audit event for every save and delete made through the admin."""

    audit_entity = ""

    def save_related(self, request: HttpRequest, form: Any, formsets: Any, change: bool) -> None:
        # After the many-to-many fields are saved, so the event describes the final state.
        super().save_related(request, form, formsets, change)
        audit_record(
            actor=request.user,
            action=f"{self.audit_entity}.{'update' if change else 'create'}",
            obj=form.instance,
            changes={f: _plain(form.cleaned_data.get(f)) for f in form.changed_data},
        )

    def delete_model(self, request: HttpRequest, obj: Any) -> None:
        audit_record(actor=request.user, action=f"{self.audit_entity}.delete", obj=obj)
        super().delete_model(request, obj)

    def delete_queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> None:
        for obj in queryset:
            audit_record(actor=request.user, action=f"{self.audit_entity}.delete", obj=obj)
        super().delete_queryset(request, queryset)


class TenantAdminForm(forms.ModelForm):
    class Meta:
        model = Tenant
        fields = [
            "slug",
            "name",
            "allowed_jurisdictions",
            "allowed_regions",
            "requests_per_minute",
            "tokens_per_minute",
            "monthly_budget_usd",
            "is_active",
        ]

    def clean(self) -> dict[str, Any]:
        data = super().clean() or {}
        errors = tenant_residency_errors(
            data.get("allowed_jurisdictions") or [], data.get("allowed_regions") or []
        )
        for field, messages in errors.items():
            for message in messages:
                self.add_error(field, message)
        return data


@admin.register(Tenant)
class TenantAdmin(AuditedAdmin):
    audit_entity = "tenant"
    form = TenantAdminForm
    list_display = ["slug", "name", "allowed_jurisdictions", "requests_per_minute", "is_active"]
    list_filter = ["is_active"]
    search_fields = ["slug", "name"]
    filter_horizontal = ["allowed_regions"]


@admin.register(ApiKey)
class ApiKeyAdmin(ReadOnlyAdmin):
    """Browsing only. Revoke through the API instead: that is audited and keeps the history."""

    list_display = ["prefix", "name", "tenant", "expires_at", "revoked_at", "last_used_at"]
    list_filter = ["tenant"]
    search_fields = ["prefix", "name", "tenant__slug"]
    fields = (
        "tenant",
        "name",
        "prefix",
        "scopes",
        "monthly_budget_usd",
        "expires_at",
        "revoked_at",
        "previous_prefix",
        "previous_key_valid_until",
        "last_used_at",
        "created_by",
        "created_at",
    )
    readonly_fields = fields


@admin.register(AuthToken)
class AuthTokenAdmin(admin.ModelAdmin):
    """People's API tokens: who holds one, until when. Deleting one revokes it."""

    list_display = ["prefix", "user", "created_at", "expires_at", "last_used_at"]
    search_fields = ["prefix", "user__username"]
    fields = ("user", "prefix", "created_at", "expires_at", "last_used_at")
    readonly_fields = fields

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False  # issued by logging in (POST /api/v1/auth/token/), shown once

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


@admin.register(Membership)
class MembershipAdmin(AuditedAdmin):
    audit_entity = "membership"
    list_display = ["user", "role", "tenant"]
    list_filter = ["role", "tenant"]
    search_fields = ["user__username"]
