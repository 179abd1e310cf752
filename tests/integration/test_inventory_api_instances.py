"""The inventory REST API for instances and edges: the instance lifecycle through the
transition, drain and undrain actions (illegal moves a 409), bad input, the max_replicas
bound, heartbeat updates and filters; and edge registration, updates, filters and deletes,
each with its audit trail."""

from __future__ import annotations

from typing import Any

import pytest
from rest_framework.test import APIClient

from federation.inventory.models import Deployment, Edge, Instance
from tests.integration.inventory_api_support import (  # noqa: F401  (fixture)
    API,
    actions_for,
    counts,
    deployment_fixture,
    fleet_fixture,
)
from tests.integration.inventory_factories import make_instance

pytestmark = pytest.mark.django_db


# --- instances -----------------------------------------------------------------------------


def test_instance_lifecycle_through_the_api(
    admin_client: APIClient, deployment: Deployment
) -> None:
    created = admin_client.post(
        f"{API}/instances/",
        {"deployment": deployment.pk, "name": "i-1", "endpoint_url": "http://10.0.0.1:8000"},
        format="json",
    )
    assert created.status_code == 201, created.json()
    assert created.json()["state"] == "pending"
    url = f"{API}/instances/{created.json()['id']}"

    illegal = admin_client.post(f"{url}/transition/", {"state": "ready"}, format="json")
    assert illegal.status_code == 409
    assert illegal.json() == {
        "detail": "An instance in state 'pending' cannot move to 'ready'; "
        "allowed from 'pending': loading, stopped, failed.",
        "code": "illegal_transition",
    }
    assert admin_client.post(f"{url}/drain/").status_code == 409
    for state in ("loading", "warming", "ready"):
        response = admin_client.post(f"{url}/transition/", {"state": state}, format="json")
        assert response.status_code == 200, response.json()
        assert response.json()["state"] == state

    drained = admin_client.post(f"{url}/drain/")
    assert (drained.json()["state"], drained.json()["drain_reason"]) == ("draining", "operator")
    assert admin_client.post(f"{url}/drain/").status_code == 200  # idempotent
    undrained = admin_client.post(f"{url}/undrain/")
    assert (undrained.json()["state"], undrained.json()["drain_reason"]) == ("ready", "")

    assert admin_client.delete(f"{url}/").status_code == 409  # still serving
    assert admin_client.post(f"{url}/transition/", {"state": "stopped"}).status_code == 200
    instance = Instance.objects.get(name="i-1")
    assert admin_client.delete(f"{url}/").status_code == 204
    assert actions_for(instance) == [
        "instance.delete",
        *["instance.transition"] * 6,
        "instance.create",
    ]


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"state": "serving"}, "state"),
        ({"state": ""}, "state"),
        ({}, "state"),
        ({"state": "loading", "force": True}, "force"),
    ],
)
def test_transition_bad_input(
    admin_client: APIClient, deployment: Deployment, body: dict[str, Any], field: str
) -> None:
    instance = make_instance(deployment, "i-1")
    response = admin_client.post(f"{API}/instances/{instance.pk}/transition/", body, format="json")
    assert response.status_code == 400
    assert field in response.json()
    instance.refresh_from_db()
    assert instance.state == "pending"


def test_instances_beyond_max_replicas_are_refused(
    admin_client: APIClient, deployment: Deployment
) -> None:
    make_instance(deployment, "i-1")
    stopped = make_instance(deployment, "i-2", "stopped")
    make_instance(deployment, "i-3")
    before = counts()
    response = admin_client.post(
        f"{API}/instances/",
        {"deployment": deployment.pk, "name": "i-4", "endpoint_url": "http://i-4.local:8000"},
        format="json",
    )
    assert response.status_code == 409
    assert "max_replicas is 2" in response.json()["detail"]
    restart = admin_client.post(f"{API}/instances/{stopped.pk}/transition/", {"state": "pending"})
    assert restart.status_code == 409, restart.json()
    assert counts() == before


@pytest.mark.parametrize(
    ("body", "field", "text"),
    [
        ({"name": "\u0399-1"}, "name", "lowercase letters"),  # Greek capital iota
        ({"endpoint_url": "not a url"}, "endpoint_url", "valid URL"),
        # Not an origin: the edges would refuse the whole routing table naming it.
        ({"endpoint_url": "http://i-1.local:8000/v1"}, "endpoint_url", "valid URL"),
        ({"endpoint_url": "http://user:pw@i-1.local:8000"}, "endpoint_url", "valid URL"),
        ({"endpoint_url": "http://i-1.local:8000?x=1"}, "endpoint_url", "valid URL"),
        ({"endpoint_url": "ftp://i-1.local:8000"}, "endpoint_url", "valid URL"),
        ({"endpoint_url": "http://i-0.local:8000"}, "endpoint_url", "already exists"),
        ({"deployment": "one"}, "deployment", "Incorrect type"),
        ({"state": "ready"}, "state", "Unknown field"),
    ],
)
def test_instance_bad_input(
    admin_client: APIClient, deployment: Deployment, body: dict[str, Any], field: str, text: str
) -> None:
    make_instance(deployment, "i-0")
    before = counts()
    full = {
        "deployment": deployment.pk,
        "name": "i-1",
        "endpoint_url": "http://i-1.local:8000",
        **body,
    }
    response = admin_client.post(f"{API}/instances/", full, format="json")
    expected = 409 if text == "already exists" else 400  # duplicates conflict with state
    assert response.status_code == expected, response.json()
    errors = response.json()["errors"] if expected == 409 else response.json()
    assert text in " ".join(errors[field])
    assert counts() == before


def test_instance_heartbeat_update_and_filters(
    admin_client: APIClient, deployment: Deployment
) -> None:
    ready = make_instance(deployment, "i-ready", "ready")
    make_instance(deployment, "i-loading", "loading")
    response = admin_client.patch(
        f"{API}/instances/{ready.pk}/",
        {"last_heartbeat_at": "2026-11-29T10:00:00Z", "load": {"running": 3, "waiting": 0}},
        format="json",
    )
    assert response.status_code == 200, response.json()
    assert response.json()["load"] == {"running": 3, "waiting": 0}
    bad = admin_client.patch(f"{API}/instances/{ready.pk}/", {"load": [1, 2]}, format="json")
    assert bad.status_code == 400

    def names(**params: Any) -> list[str]:
        return [i["name"] for i in admin_client.get(f"{API}/instances/", params).json()["results"]]

    assert names(state="ready") == ["i-ready"]
    assert names(state=["ready", "loading"]) == ["i-loading", "i-ready"]
    assert names(region="us-east") == ["i-loading", "i-ready"]
    assert names(region="eu-west") == []
    assert names(deployment=deployment.pk, ordering="-name") == ["i-ready", "i-loading"]


# --- edges ---------------------------------------------------------------------------------


def test_edge_crud(admin_client: APIClient, fleet: dict[str, Any]) -> None:
    created = admin_client.post(
        f"{API}/edges/",
        {"region": "us-east", "name": "edge-a", "url": "https://edge-a.us-east.example"},
        format="json",
    )
    assert created.status_code == 201, created.json()
    pk = created.json()["id"]
    patched = admin_client.patch(
        f"{API}/edges/{pk}/",
        {"applied_table_version": 42, "last_heartbeat_at": "2026-11-29T10:00:00Z"},
        format="json",
    )
    assert patched.json()["applied_table_version"] == 42
    negative = admin_client.patch(f"{API}/edges/{pk}/", {"applied_table_version": -1})
    assert negative.status_code == 400
    assert admin_client.get(f"{API}/edges/", {"region": "us-east"}).json()["count"] == 1
    edge = Edge.objects.get(pk=pk)
    assert admin_client.delete(f"{API}/edges/{pk}/").status_code == 204
    assert actions_for(edge) == ["edge.delete", "edge.update", "edge.register"]
