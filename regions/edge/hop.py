"""Requests one edge forwards to another region's edge: the signed ``x-fedinfer-hop`` header.

Any ``x-fedinfer-hop`` value stops a second forward, so a request can never loop between
regions, whoever set the header. A value *signed by a fellow edge* also tells the receiving
edge that the tenant's rate limits were charged where the request entered: without that, a
spilled request is charged twice — once at the edge it entered, once at the edge that serves
it — and a tenant whose traffic spills gets 429s below its limit. A client cannot forge the
signature, so it cannot skip a limit by setting the header itself (an unsigned or bad value is
charged as usual).

Value: ``v1.<origin region>.<unix ms>.<key id>.<hex HMAC-SHA256>``; the MAC covers
``v1.<origin region>.<unix ms>.<SHA-256 of the body>`` under a key derived from the edges' key
ring (by default the routing-table key ring every edge of the fleet already holds), so a value
is good for one body and :data:`MAX_AGE_MS`.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping

HOP_HEADER = b"x-fedinfer-hop"
MAX_AGE_MS = 30_000
_DOMAIN = b"fedinfer-hop-v1"


def hop_keys(ring: Mapping[str, str]) -> dict[str, bytes]:
    """Per key id, the hop key derived from a key ring (the first entry signs)."""
    return {
        kid: hmac.new(key.encode(), _DOMAIN, hashlib.sha256).digest() for kid, key in ring.items()
    }


def _mac(key: bytes, region: str, ts_ms: int, body: bytes) -> str:
    digest = hashlib.sha256(body).hexdigest()
    return hmac.new(key, f"v1.{region}.{ts_ms}.{digest}".encode(), hashlib.sha256).hexdigest()


def sign_hop(keys: Mapping[str, bytes], region: str, body: bytes, now_ms: int) -> bytes:
    """The header value for a request forwarded from ``region``; ``b"1"`` without keys (it
    still stops a second forward, and the receiving edge charges the tenant again)."""
    if not keys:
        return b"1"
    kid, key = next(iter(keys.items()))
    return f"v1.{region}.{now_ms}.{kid}.{_mac(key, region, now_ms, body)}".encode()


def verify_hop(keys: Mapping[str, bytes], value: bytes, body: bytes, now_ms: int) -> str | None:
    """The origin region of a validly signed, fresh hop for this body; else None."""
    try:
        version, region, ts_text, kid, mac = value.decode("ascii").split(".")
        ts_ms = int(ts_text)
    except (UnicodeDecodeError, ValueError):
        return None
    key = keys.get(kid)
    if version != "v1" or key is None or abs(now_ms - ts_ms) > MAX_AGE_MS:
        return None
    if not hmac.compare_digest(mac, _mac(key, region, ts_ms, body)):
        return None
    return region
