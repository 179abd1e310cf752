"""Edge authentication: ``Authorization: Bearer <edge credential>``."""

from __future__ import annotations

from typing import Any

from django.contrib.auth.models import AnonymousUser
from rest_framework.authentication import BaseAuthentication
from rest_framework.exceptions import AuthenticationFailed
from rest_framework.request import Request

from federation.inventory.models import Edge
from federation.routing.distribution import EDGE_CREDENTIAL_PREFIX, edge_by_credential
from federation.tenancy.api.authentication import TokenAuthentication


class EdgeCredentialAuthentication(BaseAuthentication):
    """A Bearer credential of a registered edge: ``request.auth`` is that ``Edge`` and the user
    anonymous (an edge is no person and has no role). A Bearer value that is not an edge
    credential is tried as a staff API token, so operators may use either scheme."""

    keyword = "Bearer"

    def authenticate(self, request: Request) -> tuple[Any, Any] | None:
        header = request.META.get("HTTP_AUTHORIZATION", "")
        scheme, _, value = header.partition(" ")
        if scheme.lower() != self.keyword.lower():
            return None
        value = value.strip()
        if not value or " " in value:
            raise AuthenticationFailed("Malformed Bearer credential.")
        if value.startswith(EDGE_CREDENTIAL_PREFIX):
            edge = edge_by_credential(value)
            if edge is None:
                raise AuthenticationFailed("Unknown edge credential.")
            return AnonymousUser(), edge
        return TokenAuthentication().authenticate_credentials(value)

    def authenticate_header(self, request: Request) -> str:
        return 'Bearer realm="fedinfer"'


def authenticated_edge(request: Request) -> Edge | None:
    return request.auth if isinstance(request.auth, Edge) else None
