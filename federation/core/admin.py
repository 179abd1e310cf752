"""The audit trail in Django admin: readable, never editable."""

from __future__ import annotations

from django.contrib import admin

from federation.core.admin_site import ReadOnlyAdmin
from federation.core.models import AuditEvent


@admin.register(AuditEvent)
class AuditEventAdmin(ReadOnlyAdmin):
    list_display = ["created_at", "actor_repr", "action", "object_type", "object_id", "object_repr"]
    list_filter = ["action", "object_type"]
    search_fields = ["actor_repr", "object_id", "object_repr"]
    date_hierarchy = "created_at"
