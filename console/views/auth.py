"""Log in and out with Django's auth views; the login form counts against the same login
throttle as the API's token login and the admin's form (``federation.api.throttles``)."""

from __future__ import annotations

from typing import Any

from django.contrib.auth import views as auth_views
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect
from django.urls import reverse

from console.access import EVERYONE, STAFF, console_view
from federation.api.throttles import login_throttle_refusal
from federation.core.roles import role_of


class LoginView(auth_views.LoginView):
    template_name = "console/login.html"
    redirect_authenticated_user = True

    def post(self, request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        if (refusal := login_throttle_refusal(request)) is not None:
            return refusal
        return super().post(request, *args, **kwargs)

    def get_default_redirect_url(self) -> str:
        return reverse("console:home")


class LogoutView(auth_views.LogoutView):
    next_page = "console:login"


@console_view(*EVERYONE)
def home(request: HttpRequest) -> HttpResponse:
    """Staff start at the overview; a tenant viewer at its own tenant."""
    if role_of(request.user) in STAFF:
        return redirect("console:overview")
    return redirect("console:tenant", slug=request.user.membership.tenant.slug)  # type: ignore[union-attr]
