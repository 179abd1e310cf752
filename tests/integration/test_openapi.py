"""The OpenAPI schema is a contract: it generates without warnings and validates."""

from __future__ import annotations

import pytest
from django.core.management import call_command
from rest_framework.test import APIClient


@pytest.mark.django_db
def test_schema_generates_and_validates_without_warnings(tmp_path) -> None:
    out = tmp_path / "schema.yaml"
    # --fail-on-warn turns every drf-spectacular warning (unresolvable serializer, missing
    # path parameter type, ...) into a failure.
    call_command("spectacular", "--validate", "--fail-on-warn", "--file", str(out))
    text = out.read_text()
    assert text.startswith("openapi: 3.")
    assert "/api/v1/" in text


@pytest.mark.django_db
def test_schema_and_interactive_docs_are_served() -> None:
    client = APIClient()
    schema = client.get("/api/schema/", HTTP_ACCEPT="application/vnd.oai.openapi+json")
    assert schema.status_code == 200
    assert schema.json()["info"]["title"] == "fedinfer management API"
    docs = client.get("/api/docs/")
    assert docs.status_code == 200
    assert b"swagger" in docs.content.lower()


@pytest.mark.django_db
def test_api_root_lists_every_resource_of_every_domain(admin_client) -> None:
    root = admin_client.get("/api/v1/")
    assert root.status_code == 200
    listed = set(root.json())
    assert {"regions", "pools", "deployments", "instances", "edges"} <= listed
    assert {"tenants", "api-keys", "users", "audit-events"} <= listed
    for url in root.json().values():
        assert admin_client.get(url).status_code == 200, url


@pytest.mark.django_db
def test_region_link_upsert_documents_both_of_its_success_codes(admin_client) -> None:
    schema = admin_client.get("/api/schema/", HTTP_ACCEPT="application/vnd.oai.openapi+json").json()
    responses = schema["paths"]["/api/v1/region-links/"]["post"]["responses"]
    assert {"200", "201", "409"} <= set(responses)
