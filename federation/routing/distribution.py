"""Reads of the distribution side: the latest table of a region (signed for an edge), the
edge behind a credential, and the per-region overview of versions and the edges running them.

(``selectors.py`` holds the compiler's fleet snapshot; these are the distribution's selectors.)
"""

from __future__ import annotations

import hmac
from typing import Any

from django.conf import settings
from django.db.models import OuterRef, Prefetch, QuerySet, Subquery

from federation.inventory.models import Edge, Region
from federation.routing.models import RoutingTableVersion
from federation.tenancy.keys import hash_key
from regions.tables.signing import sign

#: Edge credentials read ``fe_<secret>``: the prefix tells them apart from staff tokens. Only
#: their hash is stored (``hash_key``, as for API keys).
EDGE_CREDENTIAL_PREFIX = "fe_"


def edge_by_credential(plaintext: str) -> Edge | None:
    """The edge whose credential this is, or None. Only hashes are stored and compared."""
    if not plaintext.startswith(EDGE_CREDENTIAL_PREFIX) or "\x00" in plaintext:
        return None
    digest = hash_key(plaintext)
    edge = Edge.objects.select_related("region").filter(credential_hash=digest).first()
    if edge is None or not hmac.compare_digest(edge.credential_hash, digest):
        return None
    return edge


def routing_table_latest(*, region: Region) -> RoutingTableVersion | None:
    return (
        RoutingTableVersion.objects.select_related("region")
        .filter(region=region)
        .order_by("-version")
        .first()
    )


def routing_table_latest_version(*, region_id: int) -> int | None:
    """Just the number: what a long-poll checks every time it wakes."""
    return (
        RoutingTableVersion.objects.filter(region_id=region_id)
        .order_by("-version")
        .values_list("version", flat=True)
        .first()
    )


def routing_table_document(table: RoutingTableVersion) -> dict[str, Any]:
    """The document an edge receives: the stored one, signed with the current key (so a
    rotated key applies to every version at once; an HMAC costs microseconds)."""
    return sign(
        table.document,
        settings.FEDINFER_TABLE_SIGNING_KEY,
        settings.FEDINFER_TABLE_SIGNING_KEY_ID,
    )


def routing_table_overview() -> QuerySet[Region]:
    """Regions with their latest version (``latest_version``, ``latest_created_at``) and
    their edges, in three queries whatever the number of regions."""
    latest = RoutingTableVersion.objects.filter(region=OuterRef("pk")).order_by("-version")
    return (
        Region.objects.annotate(
            latest_version=Subquery(latest.values("version")[:1]),
            latest_created_at=Subquery(latest.values("created_at")[:1]),
        )
        .prefetch_related(Prefetch("edges", queryset=Edge.objects.order_by("name")))
        .order_by("code")
    )


def routing_table_versions(*, region: Region) -> QuerySet[RoutingTableVersion]:
    """A region's published versions, newest first, without their documents."""
    return (
        RoutingTableVersion.objects.filter(region=region)
        .order_by("-version")
        .only("id", "region_id", "version", "created_at", "body_hash")
    )


def routing_table_at(*, region: Region, version: int) -> RoutingTableVersion | None:
    return RoutingTableVersion.objects.filter(region=region, version=version).first()
