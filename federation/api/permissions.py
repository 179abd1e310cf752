"""API permissions by role.

* admin: everything, including users and memberships;
* operator: reads and writes the fleet, tenants and API keys;
* tenant viewer: reads only what belongs to its own tenant, plus the public catalog
  (regions, models, adapters, accelerator types). Querysets are scoped by the view's
  selector, so another tenant's objects are invisible (404), never merely forbidden.
"""

from __future__ import annotations

from typing import Any

from rest_framework.permissions import SAFE_METHODS, BasePermission

from federation.core.roles import ADMIN, TENANT_VIEWER, is_staff_role, role_of


class IsStaffOrReadOnlyScoped(BasePermission):
    """Admins and operators write; tenant viewers read views that opt in with
    ``tenant_viewer_readable = True`` (and those views scope their querysets)."""

    message = "Your role does not allow this."

    def has_permission(self, request: Any, view: Any) -> bool:
        role = role_of(request.user)
        if role is None:
            return False
        if is_staff_role(request.user):
            return True
        return (
            role == TENANT_VIEWER
            and request.method in SAFE_METHODS
            and getattr(view, "tenant_viewer_readable", False)
        )


class IsStaff(BasePermission):
    """Admins and operators only, whatever the method: what the operator alone may see or do
    (pool costs, placement plans, usage dead letters). A view says what in ``staff_only``."""

    message = "Only admins and operators may do this."

    def has_permission(self, request: Any, view: Any) -> bool:
        if is_staff_role(request.user):
            return True
        what = getattr(view, "staff_only", None)
        if what:
            self.message = f"Only admins and operators {what}."
        return False


class IsAdmin(BasePermission):
    message = "Only admins may manage users and roles."

    def has_permission(self, request: Any, view: Any) -> bool:
        return role_of(request.user) == ADMIN
