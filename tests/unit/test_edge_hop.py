"""Signed hops between edges (hop.py): what a fellow edge signs verifies, nothing else does."""

from __future__ import annotations

from regions.edge.hop import MAX_AGE_MS, hop_keys, sign_hop, verify_hop

RING = hop_keys({"k2": "new secret", "k1": "old secret"})
NOW = 1_795_950_000_000
BODY = b'{"model":"llama","messages":[]}'


def test_a_signed_hop_verifies_and_names_its_origin() -> None:
    value = sign_hop(RING, "eu-west", BODY, NOW)
    assert value.startswith(b"v1.eu-west.")
    assert b".k2." in value  # the first key of the ring signs
    assert verify_hop(RING, value, BODY, NOW + 1_000) == "eu-west"


def test_an_edge_still_holding_the_old_key_only_verifies_hops_signed_with_it() -> None:
    old_only = hop_keys({"k1": "old secret"})
    assert verify_hop(old_only, sign_hop(RING, "r1", BODY, NOW), BODY, NOW) is None
    assert verify_hop(RING, sign_hop(old_only, "r1", BODY, NOW), BODY, NOW) == "r1"


def test_other_body_stale_forged_or_garbage_values_do_not_verify() -> None:
    value = sign_hop(RING, "r1", BODY, NOW)
    assert verify_hop(RING, value, BODY + b" ", NOW) is None
    assert verify_hop(RING, value, BODY, NOW + MAX_AGE_MS + 1) is None
    assert verify_hop(hop_keys({"k2": "another secret"}), value, BODY, NOW) is None
    forged = value.replace(b"v1.r1.", b"v1.r9.")
    assert verify_hop(RING, forged, BODY, NOW) is None
    for junk in (b"1", b"", b"v1.r1.x.k2.00", b"\xff\xfe", b"v2.r1.1.k2.00"):
        assert verify_hop(RING, junk, BODY, NOW) is None


def test_without_keys_a_hop_is_marked_but_unsigned() -> None:
    assert sign_hop({}, "r1", BODY, NOW) == b"1"
    assert verify_hop({}, b"1", BODY, NOW) is None
