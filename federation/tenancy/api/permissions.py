"""Permissions of the edge-facing endpoints: an edge, by its credential
(``authentication.EdgeCredentialAuthentication``), or staff; and the check that an edge speaks
only for itself. The roles' permissions are the API toolkit's (``federation.api.permissions``);
these need the ``Edge`` an edge credential stands for, which the toolkit, below every domain,
cannot name."""

from __future__ import annotations

from typing import Any

from rest_framework.exceptions import NotFound, PermissionDenied
from rest_framework.permissions import BasePermission
from rest_framework.request import Request

from federation.api.views import nul_free_or_404
from federation.core.roles import is_staff_role
from federation.inventory.models import Edge
from federation.tenancy.api.authentication import authenticated_edge


class IsEdgeOrStaff(BasePermission):
    """An authenticated edge (views then check which one) or an admin or operator."""

    message = "Only edges and staff may do this."

    def has_permission(self, request: Any, view: Any) -> bool:
        return authenticated_edge(request) is not None or is_staff_role(request.user)


class IsEdge(BasePermission):
    message = "Only an edge, with its own credential, may do this."

    def has_permission(self, request: Any, view: Any) -> bool:
        return authenticated_edge(request) is not None


def edge_speaking_for_itself(request: Request, name: str, *, doing: str) -> Edge:
    """The edge ``name`` names (a JSON 404 if none), which must be the edge whose credential
    authenticated ``request``: an edge may ``doing`` only for itself (a 403 otherwise)."""
    nul_free_or_404(name)
    target = Edge.objects.select_related("region").filter(name=name).first()
    if target is None:
        raise NotFound(f"No edge {name!r}.")
    edge = authenticated_edge(request)
    if edge is None or edge.pk != target.pk:
        raise PermissionDenied(f"An edge may {doing} only for itself.")
    return target
