"""Throttles. Rates come from settings at call time, so deployments and tests can tune them."""

from __future__ import annotations

from django.conf import settings
from rest_framework.request import Request
from rest_framework.throttling import SimpleRateThrottle
from rest_framework.views import APIView


class LoginThrottle(SimpleRateThrottle):
    """Password guesses per client address against ``POST /auth/token/``."""

    scope = "login"

    def get_rate(self) -> str:
        return str(settings.FEDINFER_LOGIN_RATE)

    def get_cache_key(self, request: Request, view: APIView) -> str:
        return self.cache_format % {"scope": self.scope, "ident": self.get_ident(request)}
