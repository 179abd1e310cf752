"""Published tables in the admin: read-only, like the fleet (writes go through services)."""

from __future__ import annotations

from django.contrib import admin

from federation.core.admin_site import ReadOnlyAdmin
from federation.routing.models import RoutingTableVersion


@admin.register(RoutingTableVersion)
class RoutingTableVersionAdmin(ReadOnlyAdmin):
    list_display = ["region", "version", "created_at", "body_hash"]
    list_select_related = ["region"]
    list_filter = ["region"]
    ordering = ["region__code", "-version"]
