"""Signed hops between edges (hop.py): what a fellow edge signs for this region, tenant and body
verifies once; nothing else does. And the hop key ring never comes from argv."""

from __future__ import annotations

from pathlib import Path

import pytest

from regions.edge.cli import build_parser, config_from_args
from regions.edge.policy.hop import MAX_AGE_MS, HopVerifier, hop_keys, sign_hop

RING = hop_keys({"k2": "new secret", "k1": "old secret"})
NOW = 1_795_950_000_000
BODY = b'{"model":"llama","messages":[]}'
AUTH = b"Bearer fi_tenant_a"


class Clock:
    def __init__(self) -> None:
        self.ms = NOW

    def __call__(self) -> int:
        return self.ms


def verifier(keys: dict[str, bytes] = RING, region: str = "r2", **kw: int) -> HopVerifier:
    return HopVerifier(keys, region, clock=Clock(), **kw)


def signed(origin: str = "r1", dest: str = "r2", auth: bytes | None = AUTH, at: int = NOW) -> bytes:
    return sign_hop(RING, origin, dest, auth, BODY, at)


def test_a_signed_hop_verifies_once_and_names_its_origin() -> None:
    value = signed("eu-west")
    assert value.startswith(b"v2.eu-west.r2.")
    assert b".k2." in value  # the first key of the ring signs
    hops = verifier()
    assert hops.verify(value, BODY, AUTH) == "eu-west"
    # Replayed (a captured header sent again): refused, so charged as usual.
    assert hops.verify(value, BODY, AUTH) is None
    # Each forward carries its own nonce.
    assert signed("eu-west") != signed("eu-west")
    assert hops.verify(signed("eu-west"), BODY, AUTH) == "eu-west"


def test_a_hop_is_good_only_at_its_destination_for_its_tenant() -> None:
    hops = verifier(region="r2")
    assert hops.verify(signed(dest="r3"), BODY, AUTH) is None
    assert hops.verify(signed(), BODY, b"Bearer fi_tenant_b") is None
    assert hops.verify(signed(), BODY, None) is None
    assert hops.verify(signed(auth=None), BODY, AUTH) is None
    # Without admission (no Authorization at all) a hop still verifies.
    assert hops.verify(signed(auth=None), BODY, None) == "r1"


def test_an_edge_still_holding_the_old_key_only_verifies_hops_signed_with_it() -> None:
    old_only = hop_keys({"k1": "old secret"})
    assert verifier(old_only).verify(signed(), BODY, AUTH) is None
    value = sign_hop(old_only, "r1", "r2", AUTH, BODY, NOW)
    assert verifier().verify(value, BODY, AUTH) == "r1"


def test_other_body_expired_forged_or_garbage_values_do_not_verify() -> None:
    hops = verifier()
    assert hops.verify(signed(), BODY + b" ", AUTH) is None
    assert hops.verify(signed(at=NOW - MAX_AGE_MS - 1), BODY, AUTH) is None
    assert hops.verify(signed(at=NOW + MAX_AGE_MS + 1), BODY, AUTH) is None
    assert verifier(hop_keys({"k2": "another secret"})).verify(signed(), BODY, AUTH) is None
    assert hops.verify(signed().replace(b"v2.r1.", b"v2.r9."), BODY, AUTH) is None
    v1 = f"v1.r1.{NOW}.k2.{'0' * 64}".encode()
    for junk in (b"1", b"", v1, b"v2.r1.r2.n.x.k2.00", b"\xff\xfe", b"v2.r1.r2"):
        assert hops.verify(junk, BODY, AUTH) is None
    assert len(hops) == 0  # nothing that failed verification is remembered


def test_a_value_expires_with_its_nonce() -> None:
    hops = verifier()
    value = signed()
    assert hops.verify(value, BODY, AUTH) == "r1"
    assert isinstance(hops.clock, Clock)
    hops.clock.ms = NOW + MAX_AGE_MS + 1
    assert hops.verify(value, BODY, AUTH) is None  # too old now, though forgotten below
    assert hops.verify(signed(at=hops.clock.ms), BODY, AUTH) == "r1"
    assert len(hops) == 1


def test_the_nonce_cache_stays_bounded_and_never_lets_a_replay_through() -> None:
    hops = verifier(max_nonces=50)
    accepted = [signed(at=NOW - 1_000 + i) for i in range(200)]
    for value in accepted:
        assert hops.verify(value, BODY, AUTH) == "r1"
        assert len(hops) <= 50
    # A flood of replays and forgeries adds nothing.
    for value in accepted:
        assert hops.verify(value, BODY, AUTH) is None
        assert hops.verify(value[:-4] + b"0000", BODY, AUTH) is None
    assert len(hops) == 50
    # Dropped early at the cap, the oldest nonces are still refused (the time floor): the cost
    # is that a genuine hop as old as those is charged again; a newer one is taken.
    assert hops.verify(signed(at=NOW - 1_000), BODY, AUTH) is None
    assert hops.verify(signed(at=NOW), BODY, AUTH) == "r1"


def test_without_keys_a_hop_is_marked_but_unsigned() -> None:
    assert sign_hop({}, "r1", "r2", AUTH, BODY, NOW) == b"1"
    assert HopVerifier({}, "r2").verify(b"1", BODY, AUTH) is None


def test_the_hop_key_ring_comes_from_a_file_or_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    args = ["--region", "r1", "--table", "t.json"]
    monkeypatch.delenv("FEDINFER_HOP_KEYS", raising=False)
    assert config_from_args(build_parser().parse_args(args)).hop_keys == {}
    ring = tmp_path / "hop-keys"
    ring.write_text("k2=new secret\nk1=old secret\n")
    cfg = config_from_args(build_parser().parse_args([*args, "--hop-keys-file", str(ring)]))
    assert cfg.hop_keys == RING and list(cfg.hop_keys) == ["k2", "k1"]
    monkeypatch.setenv("FEDINFER_HOP_KEYS", "k2=new secret,k1=old secret")
    assert config_from_args(build_parser().parse_args(args)).hop_keys == RING
    ring.write_text("\n")
    with pytest.raises(ValueError, match="is empty"):
        config_from_args(build_parser().parse_args([*args, "--hop-keys-file", str(ring)]))
    with pytest.raises(ValueError, match="cannot read"):
        config_from_args(
            build_parser().parse_args([*args, "--hop-keys-file", str(tmp_path / "none")])
        )
