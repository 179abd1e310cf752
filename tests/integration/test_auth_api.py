"""Authentication: token login/logout, session login with CSRF, and ``me``."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from django.contrib.auth.models import User
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from federation.tenancy.models import Tenant

pytestmark = pytest.mark.django_db

TOKEN = "/api/v1/auth/token/"
ME = "/api/v1/me/"


def test_token_login_me_and_logout(operator_user: User) -> None:
    client = APIClient()
    response = client.post(TOKEN, {"username": "oscar-operator", "password": "pw-oscar-operator"})
    assert response.status_code == 200, response.content
    token = response.json()["token"]
    assert Token.objects.get(user=operator_user).key == token

    client.credentials(HTTP_AUTHORIZATION=f"Token {token}")
    me = client.get(ME)
    assert me.status_code == 200
    assert me.json() == {
        "username": "oscar-operator",
        "email": "",
        "role": "operator",
        "tenant": None,
    }

    assert client.delete(TOKEN).status_code == 204
    assert not Token.objects.filter(user=operator_user).exists()
    assert client.get(ME).status_code == 401


def test_wrong_password_and_unknown_user_get_the_same_400(operator_user: User) -> None:
    client = APIClient()
    wrong = client.post(TOKEN, {"username": "oscar-operator", "password": "nope"})
    unknown = client.post(TOKEN, {"username": "nobody", "password": "nope"})
    assert wrong.status_code == unknown.status_code == 400
    assert wrong.json() == unknown.json()
    assert not Token.objects.exists()


def test_inactive_user_cannot_log_in(operator_user: User) -> None:
    operator_user.is_active = False
    operator_user.save()
    response = APIClient().post(
        TOKEN, {"username": "oscar-operator", "password": "pw-oscar-operator"}
    )
    assert response.status_code == 400


@pytest.mark.parametrize(
    "payload",
    [{}, {"username": "x"}, {"username": ["x"], "password": "y"}, {"u": "x", "password": "y"}],
)
def test_bad_login_bodies_are_400(payload: dict[str, object]) -> None:
    assert APIClient().post(TOKEN, payload).status_code == 400


def test_me_for_a_tenant_viewer_names_its_tenant(
    make_tenant: Callable[..., Tenant],
    make_viewer: Callable[[Tenant], User],
    client_for: Callable[[User | None], APIClient],
) -> None:
    viewer = make_viewer(make_tenant("acme"))
    assert client_for(viewer).get(ME).json()["tenant"] == "acme"
    assert client_for(viewer).get(ME).json()["role"] == "tenant_viewer"


def test_anonymous_gets_401_on_me_and_logout() -> None:
    assert APIClient().get(ME).status_code == 401
    assert APIClient().delete(TOKEN).status_code == 401


def test_session_auth_reads_and_writes_with_csrf(admin_user: User) -> None:
    client = APIClient(enforce_csrf_checks=True)
    assert client.login(username="alice-admin", password="pw-alice-admin")
    assert client.get(ME).json()["role"] == "admin"

    refused = client.post("/api/v1/tenants/", {"slug": "acme", "name": "Acme"})
    assert refused.status_code == 403
    assert "CSRF" in refused.json()["detail"]
    assert not Tenant.objects.exists()

    # A client holds the CSRF cookie and echoes it in the header, as the console does.
    secret = "s3cr3t" * 5 + "ab"  # 32 characters, the unmasked cookie format
    client.cookies["csrftoken"] = secret
    accepted = client.post(
        "/api/v1/tenants/", {"slug": "acme", "name": "Acme"}, HTTP_X_CSRFTOKEN=secret
    )
    assert accepted.status_code == 201, accepted.content
    assert accepted.json()["slug"] == "acme"


def test_logout_ends_a_session_login(admin_user: User) -> None:
    client = APIClient()
    assert client.login(username="alice-admin", password="pw-alice-admin")
    Token.objects.create(user=admin_user)
    assert client.delete(TOKEN).status_code == 204
    assert client.get(ME).status_code == 401
    assert not Token.objects.filter(user=admin_user).exists()


@pytest.mark.django_db
def test_password_guessing_is_throttled_with_retry_after(settings, admin_user) -> None:
    from django.core.cache import cache

    settings.FEDINFER_LOGIN_RATE = "3/min"
    cache.clear()
    client = APIClient()
    body = {"username": admin_user.username, "password": "wrong"}
    codes = [client.post("/api/v1/auth/token/", body, format="json").status_code for _ in range(4)]
    assert codes == [400, 400, 400, 429]
    last = client.post("/api/v1/auth/token/", body, format="json")
    assert last.status_code == 429 and int(last["Retry-After"]) > 0
    cache.clear()
