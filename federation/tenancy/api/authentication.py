"""``Authorization: Token <key>``: a person's API token (``POST /api/v1/auth/token/``).

DRF's ``TokenAuthentication`` parses the header; the token is then looked up by its hash
(only hashes are stored) and refused once expired.
"""

from __future__ import annotations

from typing import Any

from django.utils import timezone
from rest_framework import authentication
from rest_framework.exceptions import AuthenticationFailed

from federation.tenancy import selectors, services


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
