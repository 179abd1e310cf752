"""Requests one edge forwards to another region's edge: the signed ``x-fedinfer-hop`` header.

Any ``x-fedinfer-hop`` value stops a second forward, so a request can never loop between
regions, whoever set the header. A value *signed by a fellow edge* also tells the receiving
edge that the tenant's rate limits were charged where the request entered: without that, a
spilled request is charged twice — once at the edge it entered, once at the edge that serves
it — and a tenant whose traffic spills gets 429s below its limit. A client cannot forge the
signature, so it cannot skip a limit by setting the header itself (an unsigned or bad value is
charged as usual).

Value: ``v2.<origin>.<destination>.<nonce>.<unix ms>.<key id>.<hex HMAC-SHA256>``; the MAC
covers ``v2``, the origin and destination regions, the SHA-256 of the request's
``Authorization`` header (the forward carries the client's header as is, so the receiving edge
recomputes it), the nonce (16 random bytes, hex), the time and the SHA-256 of the body, under a
key derived from the edges' key ring (by default the routing-table key ring every edge of the
fleet already holds). So a captured value is worth nothing elsewhere: it is good for one body,
one tenant, one destination region, once (:class:`HopVerifier` remembers the nonces it
accepted), and for :data:`MAX_AGE_MS`.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping

HOP_HEADER = b"x-fedinfer-hop"
#: Marks a forward that continues a stream the origin edge relays and meters (its engine
#: failed mid-stream): the serving edge records no usage of its own for it. The hop's MAC
#: covers the marker (:func:`continuation_signed`), so it cannot be added to another request.
CONTINUATION_HEADER = b"x-fedinfer-continuation"
MAX_AGE_MS = 30_000
#: Nonces a :class:`HopVerifier` remembers at most (about 20 MB; 3,300 hops/s for 30 s).
MAX_NONCES = 100_000
_DOMAIN = b"fedinfer-hop-v1"


def hop_keys(ring: Mapping[str, str]) -> dict[str, bytes]:
    """Per key id, the hop key derived from a key ring (the first entry signs)."""
    return {
        kid: hmac.new(key.encode(), _DOMAIN, hashlib.sha256).digest() for kid, key in ring.items()
    }


def _mac(
    key: bytes,
    origin: str,
    destination: str,
    authorization: bytes | None,
    nonce: str,
    ts_ms: int,
    body: bytes,
) -> str:
    tenant = hashlib.sha256(authorization or b"").hexdigest()
    digest = hashlib.sha256(body).hexdigest()
    text = f"v2.{origin}.{destination}.{tenant}.{nonce}.{ts_ms}.{digest}"
    return hmac.new(key, text.encode(), hashlib.sha256).hexdigest()


def sign_hop(
    keys: Mapping[str, bytes],
    origin: str,
    destination: str,
    authorization: bytes | None,
    body: bytes,
    now_ms: int,
) -> bytes:
    """The header value for a request forwarded from ``origin`` to ``destination`` with this
    ``Authorization`` header; ``b"1"`` without keys (it still stops a second forward, and the
    receiving edge charges the tenant again)."""
    if not keys:
        return b"1"
    kid, key = next(iter(keys.items()))
    nonce = secrets.token_hex(16)
    mac = _mac(key, origin, destination, authorization, nonce, now_ms, body)
    return f"v2.{origin}.{destination}.{nonce}.{now_ms}.{kid}.{mac}".encode()


def continuation_signed(body: bytes) -> bytes:
    """What the hop of a continuation signs in place of its body: the body and the marker."""
    return body + b"\n" + CONTINUATION_HEADER


def _wall_ms() -> int:
    return time.time_ns() // 1_000_000


class HopVerifier:
    """Verifies hop values addressed to ``region``, each value at most once.

    The nonce of an accepted value is remembered until the value expires (:data:`MAX_AGE_MS`
    after its time). Only a value whose MAC verifies adds one, so a client adds none (a
    replayed value is refused before it is added); fellow edges add one per forward. At
    ``max_nonces`` the oldest nonce is dropped early and the time of every value accepted from
    then on must be above the dropped one's, so a dropped nonce can still never be replayed:
    what the cap costs under a flood is that a hop older than that is charged again.
    """

    def __init__(
        self,
        keys: Mapping[str, bytes],
        region: str,
        clock: Callable[[], int] = _wall_ms,
        max_nonces: int = MAX_NONCES,
    ) -> None:
        self.keys = keys
        self.region = region
        self.clock = clock
        self.max_nonces = max_nonces
        #: nonce -> unix ms when its value expires, in the order accepted.
        self._seen: OrderedDict[str, int] = OrderedDict()
        #: Values at or below this time are refused (their nonce may have been dropped).
        self._floor_ms = -1

    def __len__(self) -> int:
        return len(self._seen)

    def verify(self, value: bytes, body: bytes, authorization: bytes | None) -> str | None:
        """The origin region of a valid, fresh, first-seen hop addressed to this region for
        this ``Authorization`` header and body; else None (charge the request as usual)."""
        try:
            head, mac = value.decode("ascii").rsplit(".", 1)
            version, origin, destination, nonce, ts_text, kid = head.split(".", 5)
            ts_ms = int(ts_text)
        except (UnicodeDecodeError, ValueError):
            return None
        now = self.clock()
        key = self.keys.get(kid)
        if (
            version != "v2"
            or key is None
            or destination != self.region
            or abs(now - ts_ms) > MAX_AGE_MS
            or ts_ms <= self._floor_ms
        ):
            return None
        expected = _mac(key, origin, destination, authorization, nonce, ts_ms, body)
        if not hmac.compare_digest(mac, expected):
            return None
        seen = self._seen
        while seen and next(iter(seen.values())) < now:
            seen.popitem(last=False)
        if nonce in seen:
            return None
        if len(seen) >= self.max_nonces:
            _, expires = seen.popitem(last=False)
            self._floor_ms = max(self._floor_ms, expires - MAX_AGE_MS)
        seen[nonce] = ts_ms + MAX_AGE_MS
        return origin
