"""Shared API rules: parameters and bodies mean exactly what the OpenAPI schema says."""

from __future__ import annotations

import pytest

from federation.inventory.models import Region

REGION = {
    "code": "eu-west",
    "name": "EU West",
    "provider": "cloud",
    "latitude": 53.3,
    "longitude": -6.3,
    "jurisdiction": "EU",
}


@pytest.mark.django_db
@pytest.mark.parametrize(
    "query",
    ["offset=null", "offset=-1", "limit=0", "limit=abc", "limit=5&limit=6", "offset=1.5"],
)
def test_malformed_pagination_is_a_400_not_ignored(operator_client, query) -> None:
    response = operator_client.get(f"/api/v1/regions/?{query}")
    assert response.status_code == 400, response.content
    assert set(response.json()) <= {"limit", "offset"}


@pytest.mark.django_db
def test_pagination_limits_are_capped_and_documented(operator_client) -> None:
    response = operator_client.get("/api/v1/regions/?limit=100000")
    assert response.status_code == 200
    schema = operator_client.get(
        "/api/schema/", HTTP_ACCEPT="application/vnd.oai.openapi+json"
    ).json()
    params = {
        p["name"]: p["schema"] for p in schema["paths"]["/api/v1/regions/"]["get"]["parameters"]
    }
    assert params["limit"]["minimum"] == 1 and "maximum" not in params["limit"]
    assert params["offset"]["minimum"] == 0


@pytest.mark.django_db
@pytest.mark.parametrize("value", [False, True, "53.3", [1], {"x": 1}])
def test_numbers_must_be_json_numbers(operator_client, value) -> None:
    response = operator_client.post(
        "/api/v1/regions/", {**REGION, "latitude": value}, format="json"
    )
    assert response.status_code == 400
    assert "latitude" in response.json()
    assert not Region.objects.exists()


@pytest.mark.django_db
def test_unknown_fields_and_bad_numbers_are_reported_together(operator_client) -> None:
    response = operator_client.post(
        "/api/v1/regions/", {**REGION, "latitude": "north", "colour": "blue"}, format="json"
    )
    assert response.status_code == 400
    assert set(response.json()) == {"latitude", "colour"}


@pytest.mark.django_db
def test_a_duplicate_is_a_409_conflict_in_every_domain(operator_client) -> None:
    assert operator_client.post("/api/v1/regions/", REGION, format="json").status_code == 201
    again = operator_client.post("/api/v1/regions/", REGION, format="json")
    assert again.status_code == 409
    assert again.json()["code"] == "duplicate" and "code" in again.json()["errors"]
    tenant = {"slug": "globex", "name": "Globex"}
    assert operator_client.post("/api/v1/tenants/", tenant, format="json").status_code == 201
    again = operator_client.post("/api/v1/tenants/", tenant, format="json")
    assert again.status_code == 409 and "slug" in again.json()["errors"]
    assert again.json()["detail"].startswith("Already exists (slug:")


@pytest.mark.django_db
def test_a_duplicate_mixed_with_bad_input_stays_a_400(operator_client) -> None:
    operator_client.post("/api/v1/regions/", REGION, format="json")
    response = operator_client.post("/api/v1/regions/", {**REGION, "latitude": 500}, format="json")
    assert response.status_code == 400
    assert set(response.json()) == {"code", "latitude"}


def test_only_errors_made_of_uniqueness_codes_become_409() -> None:
    from rest_framework.exceptions import ValidationError

    from federation.api.errors import exception_handler

    duplicate = ValidationError({"slug": [ValidationError("taken", code="unique").detail[0]]})
    assert exception_handler(duplicate, {}).status_code == 409
    assert (
        exception_handler(ValidationError({}), {}).status_code == 400
    )  # no codes: not a duplicate
    mixed = ValidationError({"slug": ["taken"], "x": ["bad"]})
    assert exception_handler(mixed, {}).status_code == 400
