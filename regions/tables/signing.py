"""Sign and verify routing tables: HMAC-SHA256 over canonical JSON. Pure, no Django.

The canonical bytes of a document are ``orjson`` with sorted keys of the document without its
``signature`` field, so the signature covers every other field (version, region, tenants, ...)
and does not depend on key order or whitespace of the transport. The control plane signs with
:func:`sign`; the edge checks with :func:`verify` before it applies a table, so a tampered or
forged table is refused and the edge keeps its last good one.

Keys are named by a ``key_id`` so that they can be rotated: an edge holding the old and the
new key accepts tables signed with either.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping
from typing import Any

import orjson

from regions.tables.schema import RoutingTable, TableError, decode_table

ALG = "HMAC-SHA256"


class SignatureError(TableError):
    """The document is unsigned, signed with an unknown key, or its signature does not match."""


def _key_bytes(key: str | bytes) -> bytes:
    raw = key.encode() if isinstance(key, str) else key
    if not raw:
        raise ValueError("an empty signing key signs nothing")
    return raw


def parse_key_ring(text: str) -> dict[str, str]:
    """``"k2=<secret>,k1=<old secret>"`` (an environment variable or CLI flag) as
    ``{key_id: key}``; a malformed or duplicate entry is an error, not a silently dropped key."""
    ring: dict[str, str] = {}
    for position, item in enumerate(text.split(","), start=1):
        item = item.strip()
        if not item:
            continue
        key_id, sep, key = item.partition("=")
        key_id, key = key_id.strip(), key.strip()
        if not sep or not key_id or not key:
            # By position, not content: the entry may be a bare secret.
            raise ValueError(f"key ring entry {position} is not 'key_id=key'")
        if key_id in ring:
            raise ValueError(f"key id {key_id!r} appears twice in the key ring")
        ring[key_id] = key
    return ring


def canonical_bytes(document: Mapping[str, Any]) -> bytes:
    """What the signature covers: the document without ``signature``, keys sorted."""
    body = {k: v for k, v in document.items() if k != "signature"}
    return orjson.dumps(body, option=orjson.OPT_SORT_KEYS)


def _mac(key: str | bytes, body: bytes) -> str:
    return hmac.new(_key_bytes(key), body, hashlib.sha256).hexdigest()


def sign(document: Mapping[str, Any], key: str | bytes, key_id: str) -> dict[str, Any]:
    """A copy of ``document`` carrying ``signature = {alg, key_id, value}``."""
    if not key_id:
        raise ValueError("key_id must not be empty")
    signed = dict(document)
    signed["signature"] = {
        "alg": ALG,
        "key_id": key_id,
        "value": _mac(key, canonical_bytes(document)),
    }
    return signed


def verify(document: bytes | Mapping[str, Any], keys: Mapping[str, str | bytes]) -> RoutingTable:
    """Check the signature with the key it names, then decode strictly.

    Raises :class:`SignatureError` when no key is configured, the document is unsigned,
    names an unknown key or algorithm, or does not match; :class:`TableError` when it does
    not decode or fails the table's checks.
    """
    if not keys:
        raise SignatureError("no table verification key is configured")
    if isinstance(document, bytes | bytearray | memoryview):
        data = bytes(document)
        try:
            parsed = orjson.loads(data)
        except orjson.JSONDecodeError as exc:
            raise TableError(f"routing table is not JSON: {exc}") from exc
    else:
        parsed = dict(document)
        data = orjson.dumps(parsed)
    if not isinstance(parsed, dict):
        raise TableError("routing table must be a JSON object")
    signature = parsed.get("signature")
    if signature is None:
        raise SignatureError("routing table is unsigned")
    if not isinstance(signature, dict):
        raise SignatureError("signature must be an object")
    alg, key_id, value = signature.get("alg"), signature.get("key_id"), signature.get("value")
    if alg != ALG:
        raise SignatureError(f"unsupported signature algorithm {alg!r} (expected {ALG})")
    if not isinstance(key_id, str) or key_id not in keys:
        raise SignatureError(f"table signed with unknown key id {key_id!r}; known: {sorted(keys)}")
    if not isinstance(value, str):
        raise SignatureError("signature value must be a string")
    expected = _mac(keys[key_id], canonical_bytes(parsed))
    if not hmac.compare_digest(expected.encode(), value.encode()):
        raise SignatureError(f"signature does not match (key id {key_id!r}): table tampered")
    return decode_table(data)
