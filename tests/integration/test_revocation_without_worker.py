"""Taking access away reaches the edges while the worker and Redis are down.

A real ``fedinfer serve`` runs with ``REDIS_URL`` (and the broker) pointing at a port where
nothing listens, and no worker runs: an API-key revoke, a rotation and a tenant deactivation
made through its API must each leave a new table version without the key (or tenant), served
by its table endpoint at once; and people can still log in.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from django.conf import settings as django_settings
from django.contrib.auth.models import User
from rest_framework.test import APIClient

from federation.api import throttles
from federation.inventory import services as inventory
from federation.routing import services as routing
from federation.tenancy import services as tenancy
from federation.tenancy.models import Membership
from regions.supervisor import Supervisor
from tests.integration.control_plane_support import own_redis, serve, subprocess_env
from tests.integration.inventory_factories import make_region

#: Nothing listens there.
DEAD_REDIS_URL = "redis://127.0.0.1:1/0"

pytestmark = pytest.mark.django_db(transaction=True)


@dataclass
class World:
    url: str  # the server whose Redis is down
    admin: dict[str, str]  # Authorization header of an admin
    edge: dict[str, str]  # Authorization header of the region's edge
    keys: dict[str, tenancy.IssuedKey]


@pytest.fixture
def world(procs: Supervisor, settings: Any) -> Iterator[World]:
    # This process (building the fleet) queues its recompiles in our own Redis DB; the
    # server has no Redis at all.
    with own_redis(settings, django_settings.REDIS_URL):
        region = make_region("eu-west", "EU")
        edge = inventory.edge_register(
            actor=None, region=region, name="edge-eu-1", url="http://edge-eu.local:8080"
        )
        credential = routing.edge_credential_rotate(actor=None, edge=edge)
        acme = tenancy.tenant_create(actor=None, slug="acme", name="Acme")
        globex = tenancy.tenant_create(actor=None, slug="globex", name="Globex")
        keys = {
            "revoked": tenancy.api_key_create(actor=None, tenant=acme, name="revoked"),
            "rotated": tenancy.api_key_create(actor=None, tenant=acme, name="rotated"),
            "kept": tenancy.api_key_create(actor=None, tenant=acme, name="kept"),
            "globex": tenancy.api_key_create(actor=None, tenant=globex, name="globex"),
        }
        # Hashed the way the server checks passwords (the suite's settings use MD5).
        settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.PBKDF2PasswordHasher"]
        admin = User.objects.create_user("alice-admin", password="pw-alice-admin")
        Membership.objects.create(user=admin, role=Membership.Role.ADMIN)
        token = tenancy.auth_token_issue(user=admin).plaintext
        (first,) = routing.routing_tables_publish(regions=["eu-west"])
        assert first.version == 1
        url, _ = serve(procs, subprocess_env(DEAD_REDIS_URL, FEDINFER_LOGIN_RATE="20/min"))
        yield World(
            url=url,
            admin={"Authorization": f"Token {token}"},
            edge={"Authorization": f"Bearer {credential}"},
            keys=keys,
        )


def table(world: World, known: int) -> dict[str, Any]:
    """The region's table as its edge gets it, which must be newer than ``known``."""
    r = httpx.get(
        f"{world.url}/api/v1/edges/eu-west/routing-table",
        headers={**world.edge, "If-None-Match": f'"{known}"'},
        timeout=10,
    )
    assert r.status_code == 200, (r.status_code, r.text)
    document: dict[str, Any] = r.json()
    assert document["version"] > known
    return document


def key_hashes(document: dict[str, Any]) -> dict[str, list[str]]:
    return {t["tenant"]: t["key_hashes"] for t in document["tenants"]}


def post(world: World, path: str, body: Any = None) -> httpx.Response:
    started = time.monotonic()
    r = httpx.post(f"{world.url}{path}", json=body, headers=world.admin, timeout=30)
    assert r.status_code == 200, (path, r.status_code, r.text)
    # Published in the request: no wait for a broker that is not there.
    assert time.monotonic() - started < 5, path
    return r


def test_revoke_rotate_and_deactivate_publish_without_worker_or_redis(
    world: World, procs: Supervisor
) -> None:
    k = world.keys
    v1 = key_hashes(table(world, 0))
    assert k["revoked"].api_key.key_hash in v1["acme"] and "globex" in v1

    post(world, f"/api/v1/api-keys/{k['revoked'].api_key.pk}/revoke/")
    doc = table(world, 1)
    hashes = key_hashes(doc)
    assert k["revoked"].api_key.key_hash not in hashes["acme"]
    assert k["kept"].api_key.key_hash in hashes["acme"]

    post(world, f"/api/v1/api-keys/{k['rotated'].api_key.pk}/rotate/", {"grace_seconds": 0})
    doc = table(world, doc["version"])
    assert k["rotated"].api_key.key_hash not in key_hashes(doc)["acme"]

    post(world, "/api/v1/tenants/globex/deactivate/")
    doc = table(world, doc["version"])
    assert "globex" not in key_hashes(doc)
    assert "Traceback" not in procs.output("serve")


def test_login_works_with_redis_down_and_warns_once(world: World, procs: Supervisor) -> None:
    body = {"username": "alice-admin", "password": "pw-alice-admin"}
    for _ in range(3):
        r = httpx.post(f"{world.url}/api/v1/auth/token/", json=body, timeout=10)
        assert r.status_code == 200, r.text
    token = r.json()["token"]
    me = httpx.get(f"{world.url}/api/v1/me/", headers={"Authorization": f"Token {token}"})
    assert me.json()["role"] == "admin"
    log = procs.output("serve")
    assert log.count("login throttle: the 'default' cache failed") == 1, log


def test_the_throttle_counts_in_memory_while_its_cache_fails(
    settings: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    settings.CACHES = {
        "default": {
            "BACKEND": "django.core.cache.backends.redis.RedisCache",
            "LOCATION": DEAD_REDIS_URL,
            "OPTIONS": {"socket_connect_timeout": 1, "socket_timeout": 1},
        }
    }
    settings.FEDINFER_LOGIN_RATE = "3/min"
    fallback = throttles.FallbackCache()
    fallback.local.clear()
    monkeypatch.setattr(throttles.LoginThrottle, "cache", fallback)
    body = {"username": "nobody", "password": "wrong"}
    with caplog.at_level(logging.WARNING, logger="federation.api.throttles"):
        codes = [APIClient().post("/api/v1/auth/token/", body).status_code for _ in range(4)]
    assert codes == [400, 400, 400, 429]
    warnings = [r for r in caplog.records if r.name == "federation.api.throttles"]
    assert len(warnings) == 1 and "counting attempts in this process" in warnings[0].message
    fallback.local.clear()
