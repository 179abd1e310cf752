"""Who may speak on a region's peer-sync channel (``peer_sync.py``): a report is sealed with an
HMAC-SHA256 under the region's peer key, and opened — header checked, MAC verified — before
a byte of its JSON is decoded. Pure, no I/O.

Anyone who reaches the region's Redis can publish on ``fedinfer:edge-load:<db>:<region>``; only
an edge holding the key ring can publish what its peers apply. The key of each ring entry is
``HMAC-SHA256(ring key, "fedinfer-peer-sync:" + region)``: bound to one region (a report
replayed on another region's channel does not verify), and never the ring key itself (the
table or hop MACs are not made with it). The ring is the edges' peer ring
(``--peer-keys-file`` / ``$FEDINFER_PEER_KEYS``), else in control-plane mode the table
key ring every edge already holds. The first entry signs, every entry verifies: rotating is
adding the new key second on every edge, then first, then dropping the old one.

Wire format: ``fp1 <key id> <peer id> <seq> <unix ms>\\n<report JSON><64 hex MAC>``, the MAC
over everything before it. ``seq`` grows by one per message of a peer id (a restarted edge
has a new id), so a replay is refused (``PeerLoads.accept``); ``unix ms`` puts it within
:data:`MAX_AGE_MS` in the past or :data:`MAX_SKEW_MS` in the future, so a message kept
longer is refused without any state.
"""

from __future__ import annotations

import hmac
import re
from collections.abc import Mapping
from typing import NamedTuple

VERSION = b"fp1"
#: A message older than this is stale: refused, whatever its signature.
MAX_AGE_MS = 5_000
#: A message from this far in the future at most (clocks of the region's hosts differ).
MAX_SKEW_MS = 2_000
#: The header (version, key id, peer id, seq, time) is at most this long.
MAX_HEAD_BYTES = 256
MAC_HEX = 64
#: What sealing adds to a report at most.
SEAL_BYTES = MAX_HEAD_BYTES + MAC_HEX
_DOMAIN = b"fedinfer-peer-sync:"
_KEY_ID = re.compile(r"[A-Za-z0-9._-]{1,32}")
#: What a peer id may be (``peer_sync.peer_id``: name@host:pid:nonce).
PEER_ID = re.compile(rb"[A-Za-z0-9._:@-]{1,128}")


def peer_keys(ring: Mapping[str, str], region: str) -> dict[str, bytes]:
    """Per key id of ``ring`` (in order: the first signs), the region's peer-sync key."""
    keys: dict[str, bytes] = {}
    for kid, key in ring.items():
        if not _KEY_ID.fullmatch(kid):
            raise ValueError(
                f"peer-sync key id {kid!r} must be 1-32 letters, digits or . _ - (it travels "
                "in each report's header)"
            )
        keys[kid] = hmac.digest(key.encode(), _DOMAIN + region.encode(), "sha256")
    return keys


def seal(keys: Mapping[str, bytes], peer: str, seq: int, now_ms: int, body: bytes) -> bytes:
    """``body`` as a message the region's edges accept (signed with the ring's first key)."""
    kid, key = next(iter(keys.items()))
    signed = b"%s %s %s %d %d\n%s" % (VERSION, kid.encode(), peer.encode(), seq, now_ms, body)
    return signed + hmac.digest(key, signed, "sha256").hex().encode()


class Opened(NamedTuple):
    """A message whose header and MAC hold: its sender, its place in the sender's sequence,
    and its report (not decoded yet)."""

    peer: str
    seq: int
    body: memoryview


def peer_of(data: bytes) -> bytes | None:
    """The peer id a message claims, read from its header only (to skip this edge's own
    messages before any MAC is computed)."""
    head_end = data.find(b"\n", 0, MAX_HEAD_BYTES)
    if head_end < 0:
        return None
    parts = data[:head_end].split(b" ")
    return parts[2] if len(parts) == 5 else None


def open_sealed(data: bytes, keys: Mapping[str, bytes], now_ms: int) -> Opened | str:
    """The message if it is signed by the region's key ring and fresh, else why not: one of
    ``unsigned``, ``malformed``, ``unknown_key``, ``stale``, ``bad_signature``. Costs one
    HMAC of the message at most, after the checks that need none."""
    if not data.startswith(VERSION + b" "):
        return "unsigned"
    head_end = data.find(b"\n", 0, MAX_HEAD_BYTES)
    if head_end < 0 or len(data) < head_end + 1 + MAC_HEX:
        return "malformed"
    parts = data[:head_end].split(b" ")
    if len(parts) != 5:
        return "malformed"
    _, kid, peer, seq, sent = parts
    if not (
        seq.isdigit() and len(seq) <= 19 and sent.isdigit() and len(sent) <= 16
    ) or not PEER_ID.fullmatch(peer):
        return "malformed"
    key = keys.get(kid.decode("ascii", "replace"))
    if key is None:
        return "unknown_key"
    age = now_ms - int(sent)
    if age > MAX_AGE_MS or age < -MAX_SKEW_MS:
        return "stale"
    view = memoryview(data)
    mac = hmac.digest(key, view[:-MAC_HEX], "sha256").hex().encode()
    if not hmac.compare_digest(mac, data[-MAC_HEX:]):
        return "bad_signature"
    return Opened(peer.decode("ascii"), int(seq), view[head_end + 1 : -MAC_HEX])
