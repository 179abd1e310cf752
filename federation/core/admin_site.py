"""The Django admin site of fedinfer: Django's, with its login form behind the login throttle
the API uses (``federation.api.throttles``), so the admin is no side door for password
guessing; and the read-only base of the admins that only browse."""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.http import HttpRequest, HttpResponse

from federation.api.throttles import login_throttle_refusal


class ReadOnlyAdmin(admin.ModelAdmin):
    """Browse, search and filter only: writes go through the services (validated, audited),
    which the admin's plain ``save()`` would bypass."""

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


class FedinferAdminSite(admin.AdminSite):
    def login(self, request: HttpRequest, extra_context: dict[str, Any] | None = None) -> Any:
        if request.method == "POST" and (refusal := login_throttle_refusal(request)) is not None:
            return refusal
        response: HttpResponse = super().login(request, extra_context)
        return response
