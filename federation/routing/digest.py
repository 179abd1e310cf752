"""What makes two routing tables the same: the digest of a document's body. Pure.

The publisher stores a region's table only when its body differs from the latest one's. The
body is the document without the fields that change on every compile (``VOLATILE_FIELDS``);
its ``tenants`` list, identical in every region's table and most of each table's bytes at
scale, is digested on its own and stands in the body as that digest, so one compile
serialises it once rather than once per region.
"""

from __future__ import annotations

import hashlib
from typing import Any

import orjson

#: Fields that differ between two compiles of the same content.
VOLATILE_FIELDS = ("version", "generated_at", "signature")


def section_digest(section: Any) -> str:
    """SHA-256 of ``section`` as canonical JSON (keys sorted)."""
    return hashlib.sha256(orjson.dumps(section, option=orjson.OPT_SORT_KEYS)).hexdigest()


def body_hash(document: dict[str, Any], *, tenants_digest: str | None = None) -> str:
    """SHA-256 of the document's body. ``tenants_digest``: :func:`section_digest` of its
    ``tenants``, when the caller has it already (``TenantPlan.digest``); same result."""
    body = {k: v for k, v in document.items() if k not in VOLATILE_FIELDS and k != "tenants"}
    if "tenants" in document:
        body["tenants"] = tenants_digest or section_digest(document["tenants"])
    return section_digest(body)
