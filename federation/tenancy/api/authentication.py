"""Who calls the API, by credential: a person's API token (``Authorization: Token <key>``,
``POST /api/v1/auth/token/``) or an edge's credential (``Authorization: Bearer fe_…``).

DRF's ``TokenAuthentication`` parses the header; the token is then looked up by its hash
(only hashes are stored) and refused once expired. An edge credential is looked up the same
way (``selectors.edge_by_credential``); the edge-facing endpoints (its routing table, its
heartbeats, its usage) of every domain authenticate with the classes here, so they live below
all of those domains.
"""

from __future__ import annotations

from typing import Any

from django.contrib.auth.models import AnonymousUser
from django.utils import timezone
from rest_framework import authentication
from rest_framework.authentication import BaseAuthentication, SessionAuthentication
from rest_framework.exceptions import AuthenticationFailed
from rest_framework.request import Request

from federation.inventory.models import Edge
from federation.tenancy import keys, selectors, services


class TokenAuthentication(authentication.TokenAuthentication):
    keyword = "Token"

    def authenticate_credentials(self, key: str) -> tuple[Any, Any]:
        token = selectors.auth_token_by_key(key)
        if token is None:
            raise AuthenticationFailed("Invalid token.")
        now = timezone.now()
        if token.is_expired(now):
            raise AuthenticationFailed("Token expired; log in again (POST /api/v1/auth/token/).")
        if not token.user.is_active:
            raise AuthenticationFailed("User inactive or deleted.")
        services.auth_token_touch(token=token, now=now)
        return token.user, token


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
        if value.startswith(keys.EDGE_CREDENTIAL_PREFIX):
            edge = selectors.edge_by_credential(value)
            if edge is None:
                raise AuthenticationFailed("Unknown edge credential.")
            return AnonymousUser(), edge
        return TokenAuthentication().authenticate_credentials(value)

    def authenticate_header(self, request: Request) -> str:
        return 'Bearer realm="fedinfer"'


#: What an endpoint an edge reads, and staff may read too, authenticates with.
EDGE_OR_STAFF_AUTHENTICATION = [
    EdgeCredentialAuthentication,
    TokenAuthentication,
    SessionAuthentication,
]


def authenticated_edge(request: Request) -> Edge | None:
    """The edge whose credential authenticated the request, or None (a person, or nobody)."""
    return request.auth if isinstance(request.auth, Edge) else None
