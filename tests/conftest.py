"""Shared fixtures: users of each role and API clients authenticated as them."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from django.contrib.auth.models import User
from hypothesis import settings
from rest_framework.test import APIClient

from federation.tenancy.models import Membership, Tenant
from federation.tenancy.services import auth_token_issue

# Property tests check behaviour; speed is the benchmarks' (bench/). Hypothesis' default 200 ms
# deadline per example fails a good example when the 2-core machine is busy (a unit run right
# after a benchmark once failed in tests/unit/test_engine_flags.py, and passed alone).
settings.register_profile("fedinfer", deadline=None)
settings.load_profile("fedinfer")


def _user(username: str, *, role: str | None, tenant: Tenant | None = None) -> User:
    user = User.objects.create_user(username=username, password="pw-" + username)
    if role is not None:
        Membership.objects.create(user=user, role=role, tenant=tenant)
    return user


def _client(user: User | None) -> APIClient:
    client = APIClient()
    if user is not None:
        issued = auth_token_issue(user=user)
        client.credentials(HTTP_AUTHORIZATION=f"Token {issued.plaintext}")
    return client


@pytest.fixture
def admin_user(db: None) -> User:
    return _user("alice-admin", role=Membership.Role.ADMIN)


@pytest.fixture
def operator_user(db: None) -> User:
    return _user("oscar-operator", role=Membership.Role.OPERATOR)


@pytest.fixture
def make_tenant(db: None) -> Callable[..., Tenant]:
    def make(slug: str, **fields: object) -> Tenant:
        return Tenant.objects.create(slug=slug, name=fields.pop("name", slug.title()), **fields)

    return make


@pytest.fixture
def make_viewer(db: None) -> Callable[[Tenant], User]:
    def make(tenant: Tenant) -> User:
        return _user(f"viewer-{tenant.slug}", role=Membership.Role.TENANT_VIEWER, tenant=tenant)

    return make


@pytest.fixture
def client_for() -> Callable[[User | None], APIClient]:
    """``client_for(user)``: an API client with that user's token (``None``: anonymous)."""
    return _client


@pytest.fixture
def admin_client(admin_user: User) -> APIClient:
    return _client(admin_user)


@pytest.fixture
def operator_client(operator_user: User) -> APIClient:
    return _client(operator_user)
