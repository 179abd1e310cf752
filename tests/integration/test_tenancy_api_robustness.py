"""Request-level corners of the tenancy API, many found by fuzzing (real PostgreSQL): malformed
and oversized bodies, impossible lookups, malformed filters and datetimes PostgreSQL cannot
store are each a clear 4xx that writes nothing, never a database error; the OpenAPI schema
refuses unknown input fields and marks nullable outputs; lists take a fixed number of
queries however many rows they hold."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.db import connection
from django.test.utils import CaptureQueriesContext
from rest_framework.test import APIClient

from federation.inventory.models import Region
from federation.tenancy import services
from federation.tenancy.models import Tenant
from tests.integration.tenancy_api_support import (  # noqa: F401  (fixture)
    AUDIT,
    KEYS,
    TENANTS,
    USERS,
    counts,
    regions_fixture,
)

pytestmark = pytest.mark.django_db


@pytest.mark.parametrize(
    ("body", "content_type"),
    [
        (b'{"slug": "acme", "name": ', "application/json"),
        (b"\xff\xfe not utf-8", "application/json"),
        (b"[1, 2, 3]", "application/json"),
        (b'"just a string"', "application/json"),
        (b"slug=acme&name=Acme", "application/x-www-form-urlencoded"),
    ],
)
def test_malformed_bodies_are_4xx_and_write_nothing(
    admin_client: APIClient, body: bytes, content_type: str
) -> None:
    before = counts()
    response = admin_client.generic("POST", TENANTS, body, content_type=content_type)
    assert response.status_code in {400, 415}, response.content
    assert counts() == before


def test_huge_payload_is_a_413_and_writes_nothing(admin_client: APIClient, settings: Any) -> None:
    before = counts()
    huge = b'{"slug": "acme", "name": "' + b"x" * (settings.DATA_UPLOAD_MAX_MEMORY_SIZE + 1) + b'"}'
    response = admin_client.generic("POST", TENANTS, huge, content_type="application/json")
    assert response.status_code == 413
    assert response.json()["code"] == "payload_too_large"
    assert counts() == before


@pytest.mark.parametrize(
    "path",
    [
        "/api/v1/tenants/%00acme/",
        "/api/v1/tenants/%C2%84/deactivate/",
        "/api/v1/api-keys/99999999999999999999999/",
        "/api/v1/api-keys/abc/",
        "/api/v1/audit-events/-1/",
    ],
)
def test_impossible_lookups_are_json_404s(admin_client: APIClient, path: str) -> None:
    response = admin_client.get(path) if "deactivate" not in path else admin_client.post(path)
    assert response.status_code == 404
    assert response["Content-Type"] == "application/json"


@pytest.mark.parametrize(
    ("url", "query"),
    [
        (TENANTS, "is_active=null"),
        (TENANTS, "is_active=perhaps"),
        (KEYS, "revoked=maybe"),
        (USERS, "is_active=2"),
        (AUDIT, "created_after=not-a-date"),
        (TENANTS, "offset=-1"),
    ],
)
def test_malformed_filters_are_400s_not_ignored(
    admin_client: APIClient, url: str, query: str
) -> None:
    assert admin_client.get(f"{url}?{query}").status_code == 400


@pytest.mark.parametrize(
    "when",
    ["2999-01-01T00:00:00-21:26", "9999-12-31T23:59:59-10:00", "0001-01-01T00:00:00+05:00"],
)
def test_datetimes_postgres_cannot_store_are_400s(
    operator_client: APIClient, make_tenant: Callable[..., Tenant], when: str
) -> None:
    make_tenant("acme")
    created = operator_client.post(KEYS, {"tenant": "acme", "name": "k", "expires_at": when})
    if when.startswith("2999"):
        # an offset PostgreSQL refuses is converted to UTC, so the key is stored
        assert created.status_code == 201, created.content
        assert created.json()["expires_at"] == "2999-01-01T21:26:00Z"
    else:
        assert created.status_code == 400
        assert "expires_at" in created.json()
    listed = operator_client.get(AUDIT, {"created_after": when, "created_before": when})
    if when.startswith("2999"):
        assert listed.json()["count"] == 0
    else:
        assert listed.status_code == 400


def test_schema_says_strict_inputs_refuse_unknown_fields(admin_client: APIClient) -> None:
    schema = admin_client.get("/api/schema/", HTTP_ACCEPT="application/vnd.oai.openapi+json").json()
    components = schema["components"]["schemas"]
    for name in ["TenantCreateInputRequest", "ApiKeyCreateInputRequest", "UserCreateInputRequest"]:
        assert components[name]["additionalProperties"] is False, name
    # outputs stay open: adding a field later is not a breaking change
    assert "additionalProperties" not in components["TenantOutput"]


def test_schema_marks_every_nullable_output_field_nullable(admin_client: APIClient) -> None:
    """A null in a response must be allowed by the schema (found by schemathesis)."""
    schema = admin_client.get("/api/schema/", HTTP_ACCEPT="application/vnd.oai.openapi+json").json()
    components = schema["components"]["schemas"]
    expected = {
        "TenantOutput": ["requests_per_minute", "tokens_per_minute", "monthly_budget_usd"],
        "ApiKeyOutput": [
            "expires_at",
            "revoked_at",
            "last_used_at",
            "previous_secret_valid_until",
            "created_by",
        ],
        "UserOutput": ["role", "tenant", "last_login"],
        "MeOutput": ["role", "tenant"],
    }
    for component, fields in expected.items():
        properties = components[component]["properties"]
        for field in fields:
            assert properties[field].get("nullable") is True, (component, field)


@pytest.mark.parametrize("url", [TENANTS, KEYS, USERS])
def test_lists_take_a_fixed_number_of_queries(
    admin_client: APIClient,
    admin_user: User,
    make_tenant: Callable[..., Tenant],
    regions: dict[str, Region],
    django_assert_max_num_queries: Any,
    url: str,
) -> None:
    """No N+1: 12 rows cost what 1 row costs."""

    def add(i: int) -> None:
        tenant = make_tenant(f"t{i}", allowed_jurisdictions=["EU"])
        tenant.allowed_regions.set([regions["eu-west"]])
        services.api_key_create(actor=admin_user, tenant=tenant, name=f"k{i}")
        services.user_create(
            actor=admin_user,
            username=f"u{i}",
            password="long-enough-pw-1",
            role="tenant_viewer",
            tenant=tenant,
        )

    add(0)
    with CaptureQueriesContext(connection) as one:
        assert admin_client.get(url).status_code == 200
    for i in range(1, 12):
        add(i)
    with django_assert_max_num_queries(len(one.captured_queries)):
        assert admin_client.get(url).json()["count"] >= 12
