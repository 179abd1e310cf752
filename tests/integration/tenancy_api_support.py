"""What the tenancy API tests share: the endpoints, three regions in two jurisdictions (a
fixture), a count of every tenancy and audit row (to show a refused request wrote nothing) and
the text of every stored key and audit row (to show a secret never reached the database)."""

from __future__ import annotations

from typing import Any

import pytest
from django.contrib.auth.models import User
from django.db import connection
from rest_framework.test import APIClient

from federation.core.models import AuditEvent
from federation.inventory.models import Region
from federation.tenancy.models import ApiKey, Membership, Tenant

TENANTS = "/api/v1/tenants/"
KEYS = "/api/v1/api-keys/"
USERS = "/api/v1/users/"
AUDIT = "/api/v1/audit-events/"


# Named apart from its function so a test taking ``regions`` does not shadow the import.
@pytest.fixture(name="regions")
def regions_fixture(db: None) -> dict[str, Region]:
    specs = [("us-east", "US", 39.0, -77.5), ("eu-west", "EU", 53.3, -6.3)]
    specs.append(("eu-central", "EU", 50.1, 8.7))
    return {
        code: Region.objects.create(
            code=code, name=code, provider="cloud", latitude=lat, longitude=lon, jurisdiction=j
        )
        for code, j, lat, lon in specs
    }


def counts() -> tuple[int, ...]:
    return (
        Tenant.objects.count(),
        Tenant.allowed_regions.through.objects.count(),
        ApiKey.objects.count(),
        User.objects.count(),
        Membership.objects.count(),
        AuditEvent.objects.count(),
    )


def all_stored_text() -> str:
    """Every text column of every tenancy and audit row, to search for a leaked secret."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT row_to_json(k)::text FROM tenancy_apikey k "
            "UNION ALL SELECT row_to_json(a)::text FROM core_auditevent a"
        )
        return "\n".join(row[0] for row in cursor.fetchall())


def assert_refused_unchanged(
    client: APIClient, url: str, payload: dict[str, Any], field: str
) -> None:
    """``payload`` POSTed to ``url`` is a 400 naming ``field``, and nothing is written."""
    before = counts()
    response = client.post(url, payload)
    assert response.status_code == 400, response.content
    assert field in response.json()
    assert counts() == before
