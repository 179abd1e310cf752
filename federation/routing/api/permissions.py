from __future__ import annotations

from typing import Any

from rest_framework.permissions import BasePermission

from federation.core.roles import is_staff_role
from federation.routing.api.authentication import authenticated_edge


class IsEdgeOrStaff(BasePermission):
    """An authenticated edge (views then check which one) or an admin or operator."""

    message = "Only edges and staff may do this."

    def has_permission(self, request: Any, view: Any) -> bool:
        return authenticated_edge(request) is not None or is_staff_role(request.user)


class IsEdge(BasePermission):
    message = "Only an edge, with its own credential, may do this."

    def has_permission(self, request: Any, view: Any) -> bool:
        return authenticated_edge(request) is not None
