"""A tenant viewer never sees another tenant's objects: by list, detail or filter; it never
writes; it never sees users or the audit trail; anonymous callers see nothing.

Table-driven: to cover a new tenant-scoped endpoint, add one ``Scoped`` row to ``SCOPED``
(and a staff-only endpoint to ``STAFF_ONLY``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
from django.contrib.auth.models import User
from rest_framework.test import APIClient

from federation.tenancy import services
from federation.tenancy.models import Tenant

pytestmark = pytest.mark.django_db


@dataclass
class World:
    """Two tenants with one object each of every tenant-scoped kind."""

    own: Tenant
    other: Tenant
    objects: dict[str, dict[str, Any]]  # kind -> {"own": obj, "other": obj}
    viewer: User
    admin: User


@dataclass(frozen=True)
class Scoped:
    name: str
    list_url: str
    # the detail path of an object, given the World and "own"/"other"
    detail: Callable[[World, str], str]
    # query parameters that name a tenant, given its slug
    tenant_filter: Callable[[str], dict[str, str]]
    # how a list item identifies its object, to compare against detail ids
    item_id: Callable[[dict[str, Any]], Any]
    object_id: Callable[[World, str], Any]
    # write attempts as (method, path, body), given the World and whose object
    writes: Callable[[World, str], list[tuple[str, str, dict[str, Any]]]]


def _tenant_writes(w: World, whose: str) -> list[tuple[str, str, dict[str, Any]]]:
    slug = getattr(w, whose).slug
    return [
        ("post", "/api/v1/tenants/", {"slug": "sneaky", "name": "Sneaky"}),
        ("patch", f"/api/v1/tenants/{slug}/", {"requests_per_minute": 1_000_000}),
        ("delete", f"/api/v1/tenants/{slug}/", {}),
        ("post", f"/api/v1/tenants/{slug}/deactivate/", {}),
    ]


def _key_writes(w: World, whose: str) -> list[tuple[str, str, dict[str, Any]]]:
    key_id = w.objects["api-keys"][whose].pk
    return [
        ("post", "/api/v1/api-keys/", {"tenant": getattr(w, whose).slug, "name": "mine now"}),
        ("patch", f"/api/v1/api-keys/{key_id}/", {"name": "renamed"}),
        ("delete", f"/api/v1/api-keys/{key_id}/", {}),
        ("post", f"/api/v1/api-keys/{key_id}/revoke/", {}),
        ("post", f"/api/v1/api-keys/{key_id}/rotate/", {}),
    ]


SCOPED = [
    Scoped(
        name="tenants",
        list_url="/api/v1/tenants/",
        detail=lambda w, whose: f"/api/v1/tenants/{getattr(w, whose).slug}/",
        tenant_filter=lambda slug: {"slug": slug},
        item_id=lambda item: item["slug"],
        object_id=lambda w, whose: getattr(w, whose).slug,
        writes=_tenant_writes,
    ),
    Scoped(
        name="api-keys",
        list_url="/api/v1/api-keys/",
        detail=lambda w, whose: f"/api/v1/api-keys/{w.objects['api-keys'][whose].pk}/",
        tenant_filter=lambda slug: {"tenant": slug},
        item_id=lambda item: item["id"],
        object_id=lambda w, whose: w.objects["api-keys"][whose].pk,
        writes=_key_writes,
    ),
]
SCOPED_IDS = [s.name for s in SCOPED]

# Endpoints a tenant viewer may not read at all (list path, detail path given the World).
STAFF_ONLY: list[tuple[str, Callable[[World], str]]] = [
    ("/api/v1/users/", lambda w: f"/api/v1/users/{w.viewer.pk}/"),
    ("/api/v1/audit-events/", lambda w: "/api/v1/audit-events/1/"),
]


@pytest.fixture
def world(
    admin_user: User,
    make_tenant: Callable[..., Tenant],
    make_viewer: Callable[[Tenant], User],
) -> World:
    own, other = make_tenant("acme"), make_tenant("globex")
    keys = {
        whose: services.api_key_create(actor=admin_user, tenant=t, name=f"{t.slug}-key").api_key
        for whose, t in (("own", own), ("other", other))
    }
    return World(own, other, {"api-keys": keys}, make_viewer(own), admin_user)


@pytest.fixture
def viewer_client(world: World, client_for: Callable[[User | None], APIClient]) -> APIClient:
    return client_for(world.viewer)


@pytest.mark.parametrize("endpoint", SCOPED, ids=SCOPED_IDS)
def test_list_shows_only_the_viewers_tenant(
    endpoint: Scoped, world: World, viewer_client: APIClient
) -> None:
    response = viewer_client.get(endpoint.list_url)
    assert response.status_code == 200
    ids = [endpoint.item_id(item) for item in response.json()["results"]]
    assert ids == [endpoint.object_id(world, "own")]
    assert response.json()["count"] == 1


@pytest.mark.parametrize("endpoint", SCOPED, ids=SCOPED_IDS)
def test_detail_of_another_tenant_is_404_like_a_missing_object(
    endpoint: Scoped, world: World, viewer_client: APIClient, admin_client: APIClient
) -> None:
    assert viewer_client.get(endpoint.detail(world, "own")).status_code == 200
    other = viewer_client.get(endpoint.detail(world, "other"))
    assert other.status_code == 404
    # the staff view proves the object exists, so the 404 is isolation, not absence
    assert admin_client.get(endpoint.detail(world, "other")).status_code == 200


@pytest.mark.parametrize("endpoint", SCOPED, ids=SCOPED_IDS)
def test_filter_naming_another_tenant_returns_nothing(
    endpoint: Scoped, world: World, viewer_client: APIClient, admin_client: APIClient
) -> None:
    other = viewer_client.get(endpoint.list_url, endpoint.tenant_filter(world.other.slug))
    missing = viewer_client.get(endpoint.list_url, endpoint.tenant_filter("no-such-tenant"))
    assert other.status_code == 200
    assert other.json()["count"] == 0
    # naming a tenant that exists answers exactly like naming one that does not
    assert other.json() == missing.json()
    staff = admin_client.get(endpoint.list_url, endpoint.tenant_filter(world.other.slug))
    assert staff.json()["count"] == 1
    own = viewer_client.get(endpoint.list_url, endpoint.tenant_filter(world.own.slug))
    assert [endpoint.item_id(i) for i in own.json()["results"]] == [
        endpoint.object_id(world, "own")
    ]


@pytest.mark.parametrize("whose", ["own", "other"])
@pytest.mark.parametrize("endpoint", SCOPED, ids=SCOPED_IDS)
def test_viewer_writes_are_403_and_change_nothing(
    endpoint: Scoped, whose: str, world: World, viewer_client: APIClient, admin_client: APIClient
) -> None:
    before = admin_client.get(endpoint.list_url).json()
    for method, path, body in endpoint.writes(world, whose):
        response = getattr(viewer_client, method)(path, body)
        assert response.status_code == 403, (method, path, response.status_code)
    assert admin_client.get(endpoint.list_url).json() == before


@pytest.mark.parametrize("endpoint", SCOPED, ids=SCOPED_IDS)
def test_anonymous_sees_nothing(endpoint: Scoped, world: World) -> None:
    anonymous = APIClient()
    assert anonymous.get(endpoint.list_url).status_code == 401
    assert anonymous.get(endpoint.detail(world, "own")).status_code == 401
    for method, path, body in endpoint.writes(world, "own"):
        assert getattr(anonymous, method)(path, body).status_code == 401


@pytest.mark.parametrize(("list_url", "detail"), STAFF_ONLY, ids=[u for u, _ in STAFF_ONLY])
def test_viewer_and_anonymous_cannot_read_staff_only_endpoints(
    list_url: str, detail: Callable[[World], str], world: World, viewer_client: APIClient
) -> None:
    assert viewer_client.get(list_url).status_code == 403
    assert viewer_client.get(detail(world)).status_code == 403
    assert APIClient().get(list_url).status_code == 401


def test_viewer_cannot_escalate_through_users(world: World, viewer_client: APIClient) -> None:
    response = viewer_client.patch(f"/api/v1/users/{world.viewer.pk}/", {"role": "admin"})
    assert response.status_code == 403
    world.viewer.refresh_from_db()
    assert world.viewer.membership.role == "tenant_viewer"


def test_user_without_a_role_sees_nothing(client_for: Callable[[User | None], APIClient]) -> None:
    stranger = User.objects.create_user(username="stranger", password="pw-stranger-123")
    client = client_for(stranger)
    for endpoint in SCOPED:
        assert client.get(endpoint.list_url).status_code == 403
    assert client.get("/api/v1/me/").json()["role"] is None


def test_viewer_keys_never_show_secrets(world: World, viewer_client: APIClient) -> None:
    item = viewer_client.get("/api/v1/api-keys/").json()["results"][0]
    assert "key" not in item
    assert "key_hash" not in item
