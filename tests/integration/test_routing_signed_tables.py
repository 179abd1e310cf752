"""Serving a published table to a region's edges: each web process reads and signs a version
once (per signing key) and sends the same bytes to every edge, within a bound in bytes."""

from __future__ import annotations

from typing import Any

import pytest

from federation.inventory import services as inventory
from federation.routing import distribution, services
from regions.tables import signing
from tests.integration.test_routing_distribution import (  # noqa: F401  (fixtures)
    Fleet,
    edge_client,
    fleet,
    test_redis,
)


@pytest.mark.django_db
def test_a_version_is_read_and_signed_once_for_all_edges_and_again_for_a_new_key(
    fleet: Fleet,  # noqa: F811
    settings: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(distribution, "_signed_bodies", distribution._SignedBodies(2**20))
    services.routing_tables_publish()
    client = edge_client(fleet.eu_credential)
    first = client.get("/api/v1/edges/eu-west/routing-table")
    assert first.status_code == 200 and first["Content-Type"] == "application/json"
    signs: list[int] = []
    real_sign = distribution.sign
    monkeypatch.setattr(distribution, "sign", lambda *a: signs.append(1) or real_sign(*a))
    for _ in range(3):  # the region's other edges: the same bytes, signed by nobody again
        again = client.get("/api/v1/edges/eu-west/routing-table")
        assert again.content == first.content
    assert signs == []
    # A rotated key signs the same version anew; the edge's ring verifies it with that key.
    settings.FEDINFER_TABLE_SIGNING_KEY = "the next key"
    settings.FEDINFER_TABLE_SIGNING_KEY_ID = "k2"
    rotated = client.get("/api/v1/edges/eu-west/routing-table")
    assert signs == [1] and rotated.json()["signature"]["key_id"] == "k2"
    assert signing.verify(rotated.content, {"k2": "the next key"}).version == 1
    # A new version is read and signed for itself.
    inventory.region_evacuate(actor=None, region=fleet.eu)
    services.routing_tables_publish()
    newer = client.get("/api/v1/edges/eu-west/routing-table")
    assert newer["ETag"] == '"2"' and newer.json()["instances"] == []
    assert signs == [1, 1]


def test_the_signed_bodies_kept_are_bounded_in_bytes() -> None:
    bodies = distribution._SignedBodies(100)
    for i in range(5):
        bodies.put((i, 1, "h", "k"), b"x" * 40)
    assert bodies.size <= 100 and len(bodies.bodies) == 2
    assert bodies.get((4, 1, "h", "k")) == b"x" * 40 and bodies.get((0, 1, "h", "k")) is None
    bodies.put((9, 1, "h", "k"), b"y" * 101)  # larger than all of it: not kept
    assert bodies.get((9, 1, "h", "k")) is None
