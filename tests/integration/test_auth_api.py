"""Authentication: token login/logout, session login with CSRF, and ``me``."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from datetime import timedelta

import pytest
from django.contrib.auth.models import User
from django.utils import timezone
from django.utils.dateparse import parse_datetime
from rest_framework.test import APIClient

from federation.tenancy import services
from federation.tenancy.models import AuthToken, Tenant

pytestmark = pytest.mark.django_db

TOKEN = "/api/v1/auth/token/"
ME = "/api/v1/me/"


def login(username: str, password: str | None = None) -> dict[str, str]:
    response = APIClient().post(
        TOKEN, {"username": username, "password": password or f"pw-{username}"}
    )
    assert response.status_code == 200, response.content
    return response.json()


def token_client(token: str) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {token}")
    return client


def test_token_login_me_and_logout(operator_user: User) -> None:
    token = login("oscar-operator")["token"]
    client = token_client(token)
    me = client.get(ME)
    assert me.status_code == 200
    assert me.json() == {
        "username": "oscar-operator",
        "email": "",
        "role": "operator",
        "tenant": None,
    }

    assert client.delete(TOKEN).status_code == 204
    assert not AuthToken.objects.filter(user=operator_user).exists()
    assert client.get(ME).status_code == 401


def test_tokens_are_stored_hashed_with_a_visible_prefix_and_expire(
    operator_user: User, settings
) -> None:
    settings.FEDINFER_TOKEN_TTL_HOURS = 24
    before = timezone.now()
    body = login("oscar-operator")
    token = body["token"]
    stored = AuthToken.objects.get(user=operator_user)
    # Only the SHA-256 and the prefix are kept: the database cannot give the token back.
    assert stored.key_hash == hashlib.sha256(token.encode()).hexdigest()
    assert token.startswith(stored.prefix + "_") and len(token) > len(stored.prefix) + 40
    assert not AuthToken.objects.filter(key_hash=token).exists()
    expires_at = parse_datetime(body["expires_at"])
    assert expires_at == stored.expires_at
    assert timedelta(hours=24) <= expires_at - before < timedelta(hours=24, minutes=1)

    client = token_client(token)
    assert client.get(ME).status_code == 200
    stored.refresh_from_db()
    assert stored.last_used_at is not None

    AuthToken.objects.filter(pk=stored.pk).update(expires_at=timezone.now())
    refused = client.get(ME)
    assert refused.status_code == 401 and "expired" in refused.json()["detail"]


def test_token_ttl_is_a_setting(operator_user: User, settings) -> None:
    settings.FEDINFER_TOKEN_TTL_HOURS = 2
    expires_at = parse_datetime(login("oscar-operator")["expires_at"])
    assert timedelta(hours=1, minutes=59) < expires_at - timezone.now() <= timedelta(hours=2)


def test_each_login_has_its_own_token_and_logout_revokes_only_it(operator_user: User) -> None:
    first, second = login("oscar-operator")["token"], login("oscar-operator")["token"]
    assert first != second
    assert token_client(first).delete(TOKEN).status_code == 204
    assert token_client(first).get(ME).status_code == 401
    assert token_client(second).get(ME).status_code == 200


def test_unknown_malformed_and_old_drf_tokens_are_refused(operator_user: User) -> None:
    token = login("oscar-operator")["token"]
    for bad in (token[:-1] + ("A" if token[-1] != "A" else "B"), "0" * 40, "ft_x", token + "x"):
        response = token_client(bad).get(ME)
        assert response.status_code == 401, bad
        assert response.json()["detail"] == "Invalid token."


def test_new_password_and_deactivation_revoke_tokens(
    admin_client: APIClient, operator_user
) -> None:
    token = login("oscar-operator")["token"]
    url = f"/api/v1/users/{operator_user.pk}/"
    response = admin_client.patch(url, {"password": "a-new-long-password-7"}, format="json")
    assert response.status_code == 200, response.content
    assert token_client(token).get(ME).status_code == 401
    token = login("oscar-operator", "a-new-long-password-7")["token"]
    assert admin_client.patch(url, {"is_active": False}, format="json").status_code == 200
    assert token_client(token).get(ME).status_code == 401


def test_a_user_keeps_at_most_max_tokens(operator_user: User, monkeypatch) -> None:
    monkeypatch.setattr(services, "MAX_TOKENS_PER_USER", 3)
    tokens = [services.auth_token_issue(user=operator_user).plaintext for _ in range(5)]
    assert AuthToken.objects.filter(user=operator_user).count() == 3
    assert [token_client(t).get(ME).status_code for t in tokens] == [401, 401, 200, 200, 200]


def test_the_token_command_issues_one_of_ours(operator_user: User) -> None:
    from io import StringIO

    from django.core.management import call_command

    for command in ("auth_token_issue", "drf_create_token"):  # the second: DRF's old name
        out = StringIO()
        call_command(command, "oscar-operator", stdout=out)
        words = out.getvalue().split()
        assert words[0:2] == ["Generated", "token"] and words[3:] == [
            "for",
            "user",
            "oscar-operator",
        ]
        assert token_client(words[2]).get(ME).status_code == 200


def test_wrong_password_and_unknown_user_get_the_same_400(operator_user: User) -> None:
    client = APIClient()
    wrong = client.post(TOKEN, {"username": "oscar-operator", "password": "nope"})
    unknown = client.post(TOKEN, {"username": "nobody", "password": "nope"})
    assert wrong.status_code == unknown.status_code == 400
    assert wrong.json() == unknown.json()
    assert not AuthToken.objects.exists()


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
    assert client.delete(TOKEN).status_code == 204
    assert client.get(ME).status_code == 401


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


# --- login throttling: keyed on the real client address, also at the admin's door -----------


@pytest.fixture
def login_rate(settings):
    """A tight login rate with empty counters (the suite's settings allow 10000/min)."""
    from django.core.cache import cache

    def set_rate(rate: str, *, trusted_proxies: int = 0) -> None:
        settings.FEDINFER_LOGIN_RATE = rate
        settings.FEDINFER_TRUSTED_PROXIES = trusted_proxies

    cache.clear()
    yield set_rate
    cache.clear()


def test_forged_x_forwarded_for_does_not_escape_the_login_throttle(admin_user, login_rate):
    login_rate("20/min")  # the default rate, no proxy in front
    client = APIClient()
    body = {"username": admin_user.username, "password": "wrong"}
    codes = [
        client.post(TOKEN, body, format="json", HTTP_X_FORWARDED_FOR=f"198.51.100.{i}").status_code
        for i in range(25)
    ]
    assert codes == [400] * 20 + [429] * 5


def test_behind_trusted_proxies_the_address_they_recorded_is_the_client(admin_user, login_rate):
    login_rate("3/min", trusted_proxies=2)
    client = APIClient()
    body = {"username": admin_user.username, "password": "wrong"}

    def attempt(xff: str) -> int:
        return client.post(TOKEN, body, format="json", HTTP_X_FORWARDED_FOR=xff).status_code

    # Our two proxies append what they saw: the client (203.0.113.7), then the outer proxy.
    # Whatever the client wrote further left changes nothing.
    codes = [attempt(f"10.9.9.{i}, 203.0.113.7, 10.0.0.2") for i in range(4)]
    assert codes == [400, 400, 400, 429]
    # Another client behind the same proxies has a budget of its own.
    assert attempt("203.0.113.8, 10.0.0.2") == 400
    # A header our proxies did not complete (too short) counts against the peer address.
    assert [attempt("203.0.113.9") for _ in range(3)] == [400, 400, 400]
    assert attempt("203.0.113.10") == 429


@pytest.mark.parametrize(
    ("trusted", "xff", "expected"),
    [
        (0, "198.51.100.1", "127.0.0.1"),
        (0, None, "127.0.0.1"),
        (1, "198.51.100.1", "198.51.100.1"),
        (1, "1.1.1.1, 198.51.100.1", "198.51.100.1"),
        (2, "1.1.1.1, 198.51.100.1, 10.0.0.2", "198.51.100.1"),
        (2, "198.51.100.1", "127.0.0.1"),  # fewer addresses than proxies
        (1, "1.1.1.1, not-an-address", "127.0.0.1"),
        (1, " 2001:db8::1 ", "2001:db8::1"),
    ],
)
def test_client_address(settings, trusted: int, xff: str | None, expected: str) -> None:
    from django.test import RequestFactory

    from federation.api.throttles import client_address

    settings.FEDINFER_TRUSTED_PROXIES = trusted
    extra = {"HTTP_X_FORWARDED_FOR": xff} if xff is not None else {}
    assert client_address(RequestFactory().post("/", **extra)) == expected


def test_admin_login_shares_the_throttle_and_refuses_with_429(admin_user, login_rate, client):
    login_rate("3/min")
    form = {"username": admin_user.username, "password": "wrong", "next": "/admin/"}
    first = client.post("/admin/login/", form, HTTP_X_FORWARDED_FOR="198.51.100.1")
    assert first.status_code == 200 and b"Please enter the correct" in first.content
    assert client.post("/admin/login/", form).status_code == 200
    # The API's login door counts against the same budget.
    body = {"username": admin_user.username, "password": "wrong"}
    assert APIClient().post(TOKEN, body, format="json").status_code == 400
    refused = client.post("/admin/login/", {**form, "password": "pw-alice-admin"})
    assert refused.status_code == 429 and int(refused["Retry-After"]) > 0
    assert "_auth_user_id" not in client.session  # the right password did not get through
    assert APIClient().post(TOKEN, body, format="json").status_code == 429
    # Reading the form is not an attempt.
    assert client.get("/admin/login/").status_code == 200


def test_under_fedinfer_serve_x_forwarded_for_does_not_pick_the_bucket(db, procs) -> None:
    """uvicorn would take X-Forwarded-For from a loopback peer as the client address; with
    FEDINFER_TRUSTED_PROXIES=0 nothing but the peer counts."""
    import httpx
    import redis
    from django.conf import settings

    from tests.integration.control_plane_support import serve, subprocess_env

    redis.Redis.from_url(settings.REDIS_URL).flushdb()  # the throttle's counters
    env = subprocess_env(settings.REDIS_URL, FEDINFER_LOGIN_RATE="3/min")
    url, _ = serve(procs, env)
    body = {"username": "nobody", "password": "wrong"}
    codes = [
        httpx.post(f"{url}{TOKEN}", json=body, headers={"X-Forwarded-For": f"198.51.100.{i}"})
        for i in range(4)
    ]
    assert [r.status_code for r in codes] == [400, 400, 400, 429]
    redis.Redis.from_url(settings.REDIS_URL).flushdb()
