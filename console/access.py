"""Who may open which console page: the roles of ``federation.core.roles``, checked on every
view by one decorator, the way the REST API's permissions check them.

Anonymous visitors go to the login page; a logged-in user whose role is not allowed gets a
403 page. Objects of another tenant are never forbidden but absent (404): the views load them
through the tenant-scoped selectors.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import wraps
from typing import Any

from django.contrib.auth.views import redirect_to_login
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render
from django.urls import reverse

from federation.core.roles import ADMIN, OPERATOR, TENANT_VIEWER, role_of

#: Roles that see and change the fleet, tenants and keys.
STAFF = (ADMIN, OPERATOR)
EVERYONE = (ADMIN, OPERATOR, TENANT_VIEWER)

View = Callable[..., HttpResponse]


def forbidden(
    request: HttpRequest, message: str = "Your role does not allow this."
) -> HttpResponse:
    return render(request, "console/forbidden.html", {"message": message}, status=403)


def console_view(*roles: str) -> Callable[[View], View]:
    """Require a login and one of ``roles``."""
    allowed = frozenset(roles)

    def decorate(view: View) -> View:
        @wraps(view)
        def guarded(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
            if not request.user.is_authenticated:
                return redirect_to_login(request.get_full_path(), reverse("console:login"))
            if role_of(request.user) not in allowed:
                return forbidden(request)
            return view(request, *args, **kwargs)

        return guarded

    return decorate
