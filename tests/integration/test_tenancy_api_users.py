"""Users and their roles through the REST API (real PostgreSQL): an admin creates, promotes
and deletes users (passwords stored hashed and never returned), bad or duplicate input is
refused without a write, an admin cannot lock itself out, a password change revokes the
user's token, and an operator cannot manage users."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from django.contrib.auth.models import User
from rest_framework.test import APIClient

from federation.core.models import AuditEvent
from federation.tenancy.models import Tenant
from tests.integration.tenancy_api_support import (
    TENANTS,
    USERS,
    all_stored_text,
    assert_refused_unchanged,
    counts,
)

pytestmark = pytest.mark.django_db


def test_duplicate_username_is_a_409_and_writes_nothing(admin_client: APIClient) -> None:
    before = counts()
    response = admin_client.post(
        USERS, {"username": "alice-admin", "password": "correct-horse-battery", "role": "admin"}
    )
    assert response.status_code == 409
    assert "username" in response.json()["errors"]
    assert counts() == before


def test_admin_manages_users_and_roles(
    admin_client: APIClient, make_tenant: Callable[..., Tenant]
) -> None:
    make_tenant("acme")
    created = admin_client.post(
        USERS,
        {
            "username": "vera",
            "email": "vera@example.com",
            "password": "correct-horse-battery",
            "role": "tenant_viewer",
            "tenant": "acme",
        },
    )
    assert created.status_code == 201, created.content
    body = created.json()
    assert body["role"] == "tenant_viewer"
    assert body["tenant"] == "acme"
    assert "password" not in body
    user = User.objects.get(username="vera")
    assert user.check_password("correct-horse-battery")
    assert "correct-horse-battery" not in user.password

    promoted = admin_client.patch(f"{USERS}{user.pk}/", {"role": "operator"})
    assert promoted.status_code == 200, promoted.content
    assert promoted.json()["role"] == "operator"
    assert promoted.json()["tenant"] is None

    assert admin_client.get(USERS, {"role": "operator"}).json()["count"] == 1
    assert admin_client.delete(f"{USERS}{user.pk}/").status_code == 204
    actions = AuditEvent.objects.filter(object_type="auth.user").values_list("action", flat=True)
    assert sorted(actions) == ["user.create", "user.delete", "user.update"]
    assert "correct-horse-battery" not in all_stored_text()


@pytest.mark.parametrize(
    ("payload", "field"),
    [
        ({"username": "v", "password": "short", "role": "operator"}, "password"),
        ({"username": "v", "password": "password", "role": "operator"}, "password"),
        ({"username": "v", "password": "correct-horse-battery", "role": "god"}, "role"),
        ({"username": "v", "password": "correct-horse-battery", "role": "tenant_viewer"}, "tenant"),
        (
            {
                "username": "v",
                "password": "correct-horse-battery",
                "role": "admin",
                "tenant": "acme",
            },
            "tenant",
        ),
        ({"username": "a b!", "password": "correct-horse-battery", "role": "admin"}, "username"),
        # An empty reference is not "no tenant" (DRF reads "" as null for related fields).
        (
            {"username": "v", "password": "correct-horse-battery", "role": "admin", "tenant": ""},
            "tenant",
        ),
        (
            {"username": "v", "password": "correct-horse-battery", "role": "admin", "email": "no"},
            "email",
        ),
        (
            {
                "username": "v",
                "password": "correct-horse-battery",
                "role": "admin",
                "is_staff": True,
            },
            "is_staff",
        ),
    ],
)
def test_bad_user_input_is_a_400_and_writes_nothing(
    admin_client: APIClient,
    make_tenant: Callable[..., Tenant],
    payload: dict[str, Any],
    field: str,
) -> None:
    make_tenant("acme")
    assert_refused_unchanged(admin_client, USERS, payload, field)


def test_admin_cannot_demote_deactivate_or_delete_itself(
    admin_client: APIClient, admin_user: User
) -> None:
    url = f"{USERS}{admin_user.pk}/"
    assert admin_client.patch(url, {"role": "operator"}).status_code == 409
    assert admin_client.patch(url, {"is_active": False}).status_code == 409
    assert admin_client.delete(url).status_code == 409


def test_password_change_revokes_the_users_token(
    admin_client: APIClient, operator_user: User, client_for: Callable[[User | None], APIClient]
) -> None:
    operator = client_for(operator_user)
    assert operator.get(TENANTS).status_code == 200
    changed = admin_client.patch(f"{USERS}{operator_user.pk}/", {"password": "another-long-secret"})
    assert changed.status_code == 200
    assert operator.get(TENANTS).status_code == 401
    event = AuditEvent.objects.get(action="user.update")
    assert event.changes == {"password": "changed"}


def test_operator_cannot_manage_users(operator_client: APIClient, admin_user: User) -> None:
    assert operator_client.get(USERS).status_code == 403
    assert operator_client.get(f"{USERS}{admin_user.pk}/").status_code == 403
    response = operator_client.post(
        USERS, {"username": "x", "password": "correct-horse-battery", "role": "admin"}
    )
    assert response.status_code == 403
