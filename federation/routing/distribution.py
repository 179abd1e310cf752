"""Reads of the distribution side: the latest table of a region (signed for an edge) and the
per-region overview of versions and the edges running them. (The edge behind a credential is
tenancy's, ``federation.tenancy.selectors.edge_by_credential``: every domain's edge endpoints
authenticate with it.)

(``selectors.py`` holds the compiler's fleet snapshot; these are the distribution's selectors.)
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, overload

import orjson
from django.conf import settings
from django.db import connection
from django.db.models import OuterRef, Prefetch, QuerySet, Subquery
from django.db.models.expressions import RawSQL

from federation.inventory.models import Edge, Region
from federation.routing.models import RoutingTableVersion
from regions.tables.signing import sign


def routing_table_latest_version(*, region_id: int) -> int | None:
    """Just the number: what a long-poll checks every time it wakes."""
    return (
        RoutingTableVersion.objects.filter(region_id=region_id)
        .order_by("-version")
        .values_list("version", flat=True)
        .first()
    )


@dataclass(frozen=True, slots=True)
class SignedTable:
    """A published version as an edge receives it: signed JSON, ready to send."""

    version: int
    body: bytes


class _SignedBodies:
    """The signed bytes of the versions served lately, by (row, signing key), at most
    ``limit`` bytes in all (least recently served go first). A region's edges fetch each new
    version one after another; reading a table of 100,000 tenants back, signing it and
    rendering it cost two seconds of CPU for each of them (``python -m bench scale``)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.size = 0
        self.bodies: OrderedDict[tuple[int, int, str, str], bytes] = OrderedDict()
        self.lock = threading.Lock()  # sync views run on several threads

    def get(self, key: tuple[int, int, str, str]) -> bytes | None:
        with self.lock:
            body = self.bodies.get(key)
            if body is not None:
                self.bodies.move_to_end(key)
            return body

    def put(self, key: tuple[int, int, str, str], body: bytes) -> None:
        with self.lock:
            if key in self.bodies or len(body) > self.limit:
                return
            self.bodies[key] = body
            self.size += len(body)
            while self.size > self.limit:
                _, gone = self.bodies.popitem(last=False)
                self.size -= len(gone)


_signed_bodies = _SignedBodies(256 * 2**20)


def routing_table_latest_signed(*, region: Region) -> SignedTable | None:
    """The region's latest version, signed with the current key (a rotated key applies to
    every version at once). The document is read from the database and signed once per
    process and key; the edges that follow get the same bytes."""
    latest = (
        RoutingTableVersion.objects.filter(region=region)
        .order_by("-version")
        .values_list("pk", "version", "body_hash")
        .first()
    )
    if latest is None:
        return None
    pk, version, body_hash = latest
    key = settings.FEDINFER_TABLE_SIGNING_KEY
    key_id = settings.FEDINFER_TABLE_SIGNING_KEY_ID
    # The content's hash too: a row number can come back after a database restore or in a
    # test database flushed with its sequences reset.
    signer = hashlib.sha256(f"{key_id}\0{key}".encode()).hexdigest()
    cache_key = (pk, version, body_hash, signer)
    body = _signed_bodies.get(cache_key)
    if body is None:
        document = RoutingTableVersion.objects.values_list("document", flat=True).get(pk=pk)
        body = orjson.dumps(sign(document, key, key_id))
        _signed_bodies.put(cache_key, body)
    return SignedTable(version, body)


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


def _latest_or(region: Region, version: int | None) -> QuerySet[RoutingTableVersion]:
    rows = RoutingTableVersion.objects.filter(region=region).select_related("region")
    rows = rows.filter(version=version) if version is not None else rows.order_by("-version")
    return rows.defer("document")


#: The stored document (qualified: the queries join the region).
_DOCUMENT = '"routing_routingtableversion"."document"'
#: A stored document without its tenants, and how many it has.
_WITHOUT_TENANTS = f"({_DOCUMENT} - 'tenants')::text"
_TENANT_COUNT = f"coalesce(jsonb_array_length({_DOCUMENT} -> 'tenants'), 0)"
#: The document with only the entry of the tenant named by the parameter among its tenants.
_ONE_TENANT = f"""(jsonb_set({_DOCUMENT}, '{{tenants}}', coalesce((
    SELECT jsonb_agg(e ORDER BY i) FROM jsonb_array_elements({_DOCUMENT} -> 'tenants')
    WITH ORDINALITY AS t(e, i) WHERE e ->> 'tenant' = %s), '[]'::jsonb)))::text"""


def routing_table_without_tenants(
    *, region: Region, version: int | None = None
) -> tuple[RoutingTableVersion, dict[str, Any], int] | None:
    """A version (the latest by default, ``document`` deferred), its document without the
    tenants, and how many tenants it has: a page that shows a few of thousands of tenants
    does not decode them all (``table_tenants`` reads the few)."""
    rows = _latest_or(region, version)
    if connection.vendor != "postgresql":
        found = rows.first()
        if found is None:
            return None
        document = dict(found.document)
        return found, document, len(document.pop("tenants", None) or ())
    annotated = rows.annotate(rest=RawSQL(_WITHOUT_TENANTS, []), tenants=RawSQL(_TENANT_COUNT, []))
    table = annotated.first()
    return None if table is None else (table, orjson.loads(table.rest), table.tenants)


class TableTenants(Sequence[dict[str, Any]]):
    """The tenant entries of a stored table whose name contains ``contains``, in the table's
    order, for a paginator: PostgreSQL counts and slices them out of the stored document."""

    _FROM = (
        "FROM routing_routingtableversion v, jsonb_array_elements(v.document -> 'tenants') "
        "WITH ORDINALITY AS t(e, i) WHERE v.id = %s AND strpos(e ->> 'tenant', %s) > 0"
    )

    def __init__(self, table_id: int, contains: str, total: int) -> None:
        """``total``: how many tenants the table has (all of them match an empty filter)."""
        self.table_id, self.contains, self.total = table_id, contains, total

    def __len__(self) -> int:
        if not self.contains:
            return self.total
        with connection.cursor() as cursor:
            cursor.execute(f"SELECT count(*) {self._FROM}", [self.table_id, self.contains])
            return int(cursor.fetchone()[0])

    def _slice(self, start: int, stop: int) -> list[dict[str, Any]]:
        if stop <= start:
            return []
        if not self.contains:  # the slice alone, not every entry expanded and skipped
            with connection.cursor() as cursor:
                cursor.execute(
                    "SELECT jsonb_path_query_array(document, %s::jsonpath)::text "
                    "FROM routing_routingtableversion WHERE id = %s",
                    [f"$.tenants[{int(start)} to {int(stop) - 1}]", self.table_id],
                )
                return list(orjson.loads(cursor.fetchone()[0]))
        with connection.cursor() as cursor:
            cursor.execute(
                f"SELECT e::text {self._FROM} ORDER BY i OFFSET %s LIMIT %s",
                [self.table_id, self.contains, start, stop - start],
            )
            return [orjson.loads(text) for (text,) in cursor.fetchall()]

    @overload
    def __getitem__(self, index: int) -> dict[str, Any]: ...

    @overload
    def __getitem__(self, index: slice) -> list[dict[str, Any]]: ...

    def __getitem__(self, index: int | slice) -> dict[str, Any] | list[dict[str, Any]]:
        if isinstance(index, slice):
            start, stop, step = index.start or 0, index.stop, index.step or 1
            if start < 0 or stop is None or stop < 0:  # counted only when it must be
                start, stop, step = index.indices(len(self))
            assert step == 1, "pages are contiguous"
            return self._slice(start, stop)
        found = self._slice(index, index + 1) if index >= 0 else []
        if not found:
            raise IndexError(index)
        return found[0]


def table_tenants(
    table: RoutingTableVersion, *, contains: str = "", total: int
) -> TableTenants | list[dict[str, Any]]:
    """The table's tenant entries whose name contains ``contains``, for a paginator; read
    by PostgreSQL a page at a time, from the decoded document elsewhere. ``total``: how many
    tenants it has (``routing_table_without_tenants``)."""
    if connection.vendor == "postgresql":
        return TableTenants(table.pk, contains, total)
    entries = table.document.get("tenants") or ()
    return [t for t in entries if contains in t["tenant"]]


def routing_table_for_tenant(
    *, region: Region, tenant: str
) -> tuple[RoutingTableVersion, bytes] | None:
    """The latest version (``document`` deferred) and its document as JSON with the entry
    of ``tenant`` alone among its tenants (none if absent): what deciding that tenant's
    requests reads, without decoding thousands of entries."""
    rows = _latest_or(region, None)
    if connection.vendor != "postgresql":
        found = rows.first()
        if found is None:
            return None
        document = found.document
        entries = [t for t in document.get("tenants") or () if t.get("tenant") == tenant]
        return found, orjson.dumps({**document, "tenants": entries})
    table = rows.annotate(one=RawSQL(_ONE_TENANT, [tenant])).first()
    return None if table is None else (table, table.one.encode())


def routing_table_at(
    *, region: Region, version: int, document: bool = True
) -> RoutingTableVersion | None:
    """One version; without its ``document`` (deferred) unless asked for."""
    rows = RoutingTableVersion.objects.filter(region=region, version=version)
    return (rows if document else rows.defer("document")).first()


#: (section, key, old entry or None, new entry or None): an entry that differs.
EntryChange = tuple[str, str, dict[str, Any] | None, dict[str, Any] | None]

#: The entries of two stored documents that differ, per list section, and the named scalars
#: of both. An entry is an object whose key is a string; the last of duplicate keys counts.
_CHANGES_SQL = """
WITH old AS (SELECT document AS d FROM routing_routingtableversion WHERE id = %(old)s),
new AS (SELECT document AS d FROM routing_routingtableversion WHERE id = %(new)s),
sections AS (SELECT * FROM unnest(%(sections)s::text[], %(keys)s::text[]) AS s(name, key)),
a AS (
    SELECT DISTINCT ON (s.name, e.v ->> s.key) s.name, e.v ->> s.key AS k, e.v
    FROM old, sections s, jsonb_array_elements(
        CASE WHEN jsonb_typeof(old.d -> s.name) = 'array' THEN old.d -> s.name ELSE '[]' END
    ) WITH ORDINALITY AS e(v, i)
    WHERE jsonb_typeof(e.v -> s.key) = 'string'
    ORDER BY s.name, e.v ->> s.key, e.i DESC
),
b AS (
    SELECT DISTINCT ON (s.name, e.v ->> s.key) s.name, e.v ->> s.key AS k, e.v
    FROM new, sections s, jsonb_array_elements(
        CASE WHEN jsonb_typeof(new.d -> s.name) = 'array' THEN new.d -> s.name ELSE '[]' END
    ) WITH ORDINALITY AS e(v, i)
    WHERE jsonb_typeof(e.v -> s.key) = 'string'
    ORDER BY s.name, e.v ->> s.key, e.i DESC
)
SELECT name, k, a.v::text, b.v::text FROM a FULL JOIN b USING (name, k)
WHERE a.v IS DISTINCT FROM b.v
UNION ALL
SELECT NULL, s.name, (old.d -> s.name)::text, (new.d -> s.name)::text
FROM old, new, unnest(%(scalars)s::text[]) AS s(name)
"""


def _json(text: str | None) -> Any:
    return None if text is None else orjson.loads(text)


def routing_table_changes(
    *,
    old: RoutingTableVersion,
    new: RoutingTableVersion,
    sections: Mapping[str, str],
    scalars: Sequence[str],
) -> tuple[list[tuple[str, Any, Any]], list[EntryChange]] | None:
    """(the ``scalars`` of both documents, the entries of their list ``sections`` — section
    name -> the field that identifies an entry — that differ). PostgreSQL compares the stored
    documents itself and sends back only what differs: two tables of thousands of tenants are
    not decoded to show the few that changed. None on another database: the caller diffs the
    documents."""
    if connection.vendor != "postgresql":
        return None
    params: dict[str, int | list[str]] = {
        "old": old.pk,
        "new": new.pk,
        "sections": list(sections),
        "keys": list(sections.values()),
        "scalars": list(scalars),
    }
    with connection.cursor() as cursor:
        cursor.execute(_CHANGES_SQL, params)
        rows = cursor.fetchall()
    found = [(section, key, _json(a), _json(b)) for section, key, a, b in rows]
    values = {key: (a, b) for section, key, a, b in found if section is None}
    return (
        [(name, *values[name]) for name in scalars],
        [(section, key, a, b) for section, key, a, b in found if section is not None],
    )
