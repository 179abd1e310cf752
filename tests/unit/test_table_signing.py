"""Signed tables: the edge applies only what the control plane signed, byte for byte."""

from __future__ import annotations

import orjson
import pytest

from regions.tables.schema import TableError
from regions.tables.signing import (
    SignatureError,
    canonical_bytes,
    parse_key_ring,
    sign,
    verify,
)

KEY = "0f" * 32
DOC = {
    "schema_version": 1,
    "version": 3,
    "region": "eu-west",
    "generated_at": "2026-11-29T10:00:00Z",
    "instances": [{"id": "eu-1", "url": "http://127.0.0.1:9000", "model": "m-8b"}],
    "remote_regions": [],
    "tenants": [{"tenant": "globex-eu", "key_hashes": ["ab" * 32], "allowed_regions": ["eu-west"]}],
}


def test_signed_bytes_verify_and_decode() -> None:
    signed = sign(DOC, KEY, "k1")
    assert signed["signature"]["alg"] == "HMAC-SHA256" and signed["signature"]["key_id"] == "k1"
    assert "signature" not in DOC  # the input is not modified
    table = verify(orjson.dumps(signed), {"k1": KEY})
    assert table.version == 3 and table.tenants is not None
    assert table.tenants[0].allowed_regions == ("eu-west",)
    # A dict works too, and key order of the transport does not matter.
    reordered = dict(reversed(list(signed.items())))
    assert verify(reordered, {"k1": KEY}).region == "eu-west"


def test_canonical_bytes_ignore_the_signature_and_key_order() -> None:
    signed = sign(DOC, KEY, "k1")
    assert canonical_bytes(signed) == canonical_bytes(dict(reversed(list(DOC.items()))))


@pytest.mark.parametrize(
    ("path", "value"),
    [
        (("tenants", 0, "allowed_regions"), ["eu-west", "us-east"]),
        (("version",), 4),
        (("instances", 0, "url"), "http://evil.example:9000"),
    ],
)
def test_a_tampered_field_is_refused(path: tuple, value: object) -> None:
    signed = orjson.loads(orjson.dumps(sign(DOC, KEY, "k1")))
    target = signed
    for step in path[:-1]:
        target = target[step]
    target[path[-1]] = value
    with pytest.raises(SignatureError, match="does not match"):
        verify(orjson.dumps(signed), {"k1": KEY})


def test_wrong_key_and_unknown_key_id_are_refused() -> None:
    signed = orjson.dumps(sign(DOC, KEY, "k1"))
    with pytest.raises(SignatureError, match="does not match"):
        verify(signed, {"k1": "another key"})
    with pytest.raises(SignatureError, match="unknown key id 'k1'"):
        verify(signed, {"k2": KEY})


def test_rotation_accepts_either_configured_key() -> None:
    new = orjson.dumps(sign(DOC, "new key", "k2"))
    assert verify(new, {"k1": KEY, "k2": "new key"}).version == 3


def test_unsigned_or_malformed_signature_is_refused_when_keys_are_configured() -> None:
    with pytest.raises(SignatureError, match="unsigned"):
        verify(orjson.dumps(DOC), {"k1": KEY})
    with pytest.raises(SignatureError, match="unsigned"):
        verify(orjson.dumps({**DOC, "signature": None}), {"k1": KEY})
    bad_alg = sign(DOC, KEY, "k1")
    bad_alg["signature"] = {**bad_alg["signature"], "alg": "none"}
    with pytest.raises(SignatureError, match="algorithm"):
        verify(orjson.dumps(bad_alg), {"k1": KEY})
    with pytest.raises(SignatureError, match="no table verification key"):
        verify(orjson.dumps(sign(DOC, KEY, "k1")), {})


def test_signed_but_invalid_table_is_still_refused_by_the_decoder() -> None:
    signed = sign({**DOC, "version": 0}, KEY, "k1")
    with pytest.raises(TableError, match="version must be a positive"):
        verify(orjson.dumps(signed), {"k1": KEY})
    with pytest.raises(TableError, match="not JSON"):
        verify(b"{not json", {"k1": KEY})


def test_empty_key_or_key_id_cannot_sign() -> None:
    with pytest.raises(ValueError, match="empty signing key"):
        sign(DOC, "", "k1")
    with pytest.raises(ValueError, match="key_id"):
        sign(DOC, KEY, "")


def test_key_ring_from_text() -> None:
    assert parse_key_ring(" k2=new , k1=old=with=equals,") == {"k2": "new", "k1": "old=with=equals"}
    assert parse_key_ring("") == {}
    with pytest.raises(ValueError, match="not 'key_id=key'"):
        parse_key_ring("k1")
    with pytest.raises(ValueError, match="not 'key_id=key'"):
        parse_key_ring("k1=")
    with pytest.raises(ValueError, match="twice"):
        parse_key_ring("k1=a,k1=b")
