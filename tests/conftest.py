"""Shared fixtures: users of each role and API clients authenticated as them."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import pytest
from django.apps import apps as global_apps
from django.contrib.auth.models import User
from django.db.models.signals import post_migrate
from hypothesis import settings
from rest_framework.test import APIClient

from federation.tenancy.models import Membership, Tenant
from federation.tenancy.services import auth_token_issue

# Property tests check behaviour; speed is the benchmarks' (bench/). Hypothesis' default 200 ms
# deadline per example fails a good example when the 2-core machine is busy (a unit run right
# after a benchmark once failed in tests/unit/test_engine_flags.py, and passed alone).
settings.register_profile("fedinfer", deadline=None)
settings.load_profile("fedinfer")

_catalog = importlib.import_module("migrations.inventory.0002_accelerator_catalog")


def _reseed_catalog(using: str, **_: Any) -> None:
    """Put back the accelerator catalog the migrations seed, after a transactional test's
    flush emptied it, so that every test, on whichever xdist worker and in whichever order,
    starts with it (rather than each transactional test restoring a serialized copy)."""
    _catalog.seed(global_apps, None)


post_migrate.connect(
    _reseed_catalog, sender=global_apps.get_app_config("inventory"), dispatch_uid="catalog"
)


#: The tier of each test folder (markers in pyproject.toml). The platform files check what ships
#: beside the code (manifests, alert rules, images) with Debian's kubectl and promtool.
TIER_OF_FOLDER = {"unit": "unit", "fuzz": "unit", "integration": "integration", "e2e": "e2e"}
PLATFORM_FILES = {"test_observability.py", "test_platform_docker.py", "test_platform_k8s.py"}


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark each test with its tier before ``-m`` selects (``make check``: ``-m unit``)."""
    for item in items:
        if item.path.name in PLATFORM_FILES:
            item.add_marker("platform")
        elif tier := TIER_OF_FOLDER.get(item.path.parent.name):
            item.add_marker(tier)


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
