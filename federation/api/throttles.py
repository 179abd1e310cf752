"""Login throttling, shared by the API (``POST /api/v1/auth/token/``) and the Django admin's
login form: one budget of password guesses per client address.

* The client address is ``REMOTE_ADDR`` unless ``FEDINFER_TRUSTED_PROXIES`` says how many
  proxies of ours stand in front (then the address those proxies recorded in
  ``X-Forwarded-For``); a header the client writes itself never chooses the bucket.
* Counters live in the shared cache (Redis), so every web process counts together. When that
  cache fails, each process counts on its own (a warning says so) instead of refusing logins.

Rates come from settings at call time, so deployments and tests can tune them.
"""

from __future__ import annotations

import ipaddress
import logging
import math
import threading
from typing import Any

from django.conf import settings
from django.core.cache import caches
from django.core.cache.backends.locmem import LocMemCache
from django.http import HttpRequest, HttpResponse
from rest_framework.request import Request
from rest_framework.throttling import SimpleRateThrottle
from rest_framework.views import APIView

logger = logging.getLogger(__name__)


def client_address(request: HttpRequest | Request) -> str:
    """The address a request comes from, as far as our own proxies vouch for it.

    With ``FEDINFER_TRUSTED_PROXIES = 0`` that is the peer (``REMOTE_ADDR``) and
    ``X-Forwarded-For`` is ignored. With N > 0 it is the Nth address from the right of
    ``X-Forwarded-For``: the one our outermost proxy saw (the N-1 to its right were written by
    our inner proxies; anything further left the client may have forged). A header with fewer
    than N addresses, or not an IP address there, did not come through our proxies: the peer
    address is used.
    """
    remote = str(request.META.get("REMOTE_ADDR") or "")
    trusted = int(settings.FEDINFER_TRUSTED_PROXIES)
    if trusted <= 0:
        return remote
    header = str(request.META.get("HTTP_X_FORWARDED_FOR") or "")
    addresses = [part.strip() for part in header.split(",") if part.strip()]
    if len(addresses) < trusted:
        return remote
    candidate = addresses[-trusted]
    try:
        return str(ipaddress.ip_address(candidate))
    except ValueError:
        return remote


class FallbackCache:
    """The default cache, or this process's memory while the default cache raises.

    A throttle must not turn a Redis outage into a login outage; during one, attempts are
    counted per web process (each process allows the full rate), and one warning per outage
    says so.
    """

    def __init__(self, alias: str = "default") -> None:
        self.alias = alias
        self.local = LocMemCache("fedinfer-throttle-fallback", {"MAX_ENTRIES": 10_000})
        self._lock = threading.Lock()
        self._failing = False

    def get(self, key: str, default: Any = None) -> Any:
        try:
            value = caches[self.alias].get(key, default)
        except Exception as exc:  # any backend failure: Redis down, timeouts, bad config
            self._failed(exc)
            return self.local.get(key, default)
        self._recovered()
        return value

    def set(self, key: str, value: Any, timeout: float | None = None) -> None:
        try:
            caches[self.alias].set(key, value, timeout)
        except Exception as exc:
            self._failed(exc)
            self.local.set(key, value, timeout)
            return
        self._recovered()

    def _failed(self, exc: Exception) -> None:
        with self._lock:
            first, self._failing = not self._failing, True
        if first:
            logger.warning(
                "login throttle: the %r cache failed (%s: %s); counting attempts in this "
                "process's memory until it is back",
                self.alias,
                type(exc).__name__,
                exc,
            )

    def _recovered(self) -> None:
        if not self._failing:
            return
        with self._lock:
            was, self._failing = self._failing, False
        if was:
            logger.info("login throttle: the %r cache is back", self.alias)


#: One per process: the fallback counters must outlive a request.
login_cache = FallbackCache()


class LoginThrottle(SimpleRateThrottle):
    """Login attempts per client address (``FEDINFER_LOGIN_RATE``), whichever door they use."""

    scope = "login"
    cache = login_cache  # type: ignore[assignment]

    def get_rate(self) -> str:
        return str(settings.FEDINFER_LOGIN_RATE)

    def get_ident(self, request: Request) -> str:
        return client_address(request)

    def get_cache_key(self, request: Request, view: APIView | None) -> str:
        return self.cache_format % {"scope": self.scope, "ident": self.get_ident(request)}


def login_throttle_refusal(request: HttpRequest) -> HttpResponse | None:
    """For login forms outside DRF (the admin's): count this attempt and return the 429 to
    answer instead, or None when the attempt may go ahead."""
    throttle = LoginThrottle()
    # The throttle reads only ``META``, which a Django request has as well as a DRF one.
    if throttle.allow_request(request, None):  # type: ignore[arg-type]
        return None
    wait = throttle.wait()
    retry_after = max(1, math.ceil(wait)) if wait is not None else 60
    response = HttpResponse(
        f"Too many login attempts from your address. Try again in {retry_after} seconds.\n",
        status=429,
        content_type="text/plain; charset=utf-8",
    )
    response["Retry-After"] = str(retry_after)
    return response
