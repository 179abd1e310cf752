"""The Content-Security-Policy of every response the control plane serves (console, admin,
the API and its docs): scripts only from this origin, never inline, never ``eval``.

The console and Django's admin need nothing more than ``'self'``: htmx, uPlot and the
console's own scripts are static files, chart data rides in ``<script
type="application/json">`` blocks (data, never executed), and no template has an inline
script, an ``on*`` attribute or a ``style`` attribute (``tests/integration/test_console_csp.py``).
Under ``/api/`` the browsable API's templates (DRF's) carry ``style`` attributes and Swagger UI
an inline ``<style>`` and ``data:`` images in its stylesheet: styles and images are relaxed
there, scripts are not (the docs page loads its init script from a URL,
``SpectacularSwaggerSplitView``).
"""

from __future__ import annotations

from django.http import HttpRequest, HttpResponse
from django.utils.deprecation import MiddlewareMixin

HEADER = "Content-Security-Policy"

_COMMON = (
    "default-src 'self'",
    "script-src 'self'",
    "object-src 'none'",
    "base-uri 'self'",
    "frame-ancestors 'none'",
    "form-action 'self'",
)
#: Console, admin and everything else.
STRICT_POLICY = "; ".join((*_COMMON, "style-src 'self'", "img-src 'self'"))
#: The browsable API and the Swagger UI docs (third-party templates): inline styles and
#: ``data:`` images allowed, scripts still only from this origin.
API_POLICY = "; ".join((*_COMMON, "style-src 'self' 'unsafe-inline'", "img-src 'self' data:"))
API_PREFIX = "/api/"


def policy_for(path: str) -> str:
    """The policy a response to ``path`` carries."""
    return API_POLICY if path.startswith(API_PREFIX) else STRICT_POLICY


def _apply(request: HttpRequest, response: HttpResponse) -> HttpResponse:
    # A view that sets its own policy keeps it.
    if HEADER not in response:
        response[HEADER] = policy_for(request.path)
    return response


class ContentSecurityPolicyMiddleware(MiddlewareMixin):
    """Adds :func:`policy_for`'s policy to every response (``MiddlewareMixin``: sync or async
    like its chain, so the long poll's async view stays async)."""

    def process_response(self, request: HttpRequest, response: HttpResponse) -> HttpResponse:
        return _apply(request, response)
