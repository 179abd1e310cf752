"""API key material: format, entropy, hashing and parsing."""

from __future__ import annotations

import hashlib

import pytest
from hypothesis import given
from hypothesis import strategies as st

from federation.tenancy.keys import (
    InvalidKeyFormat,
    generate_key,
    hash_key,
    is_well_formed,
    parse_key,
)


def test_generated_key_has_the_documented_shape() -> None:
    key = generate_key()
    assert key.plaintext.startswith(key.prefix + "_")
    assert len(key.prefix) == len("fi_") + 8
    assert is_well_formed(key.plaintext)
    parsed = parse_key(key.plaintext)
    assert parsed.prefix == key.prefix
    assert key.plaintext == f"{parsed.prefix}_{parsed.secret}"


def test_secret_carries_at_least_256_bits() -> None:
    secret = parse_key(generate_key().plaintext).secret
    # URL-safe base64: 6 bits per character.
    assert len(secret) * 6 >= 256


def test_hash_is_sha256_hex_of_the_whole_key() -> None:
    key = generate_key()
    assert key.key_hash == hashlib.sha256(key.plaintext.encode()).hexdigest()
    assert key.key_hash == hash_key(key.plaintext)
    assert len(key.key_hash) == 64


def test_keys_are_unique() -> None:
    generated = [generate_key() for _ in range(200)]
    assert len({k.plaintext for k in generated}) == 200
    assert len({k.prefix for k in generated}) == 200


def test_repr_never_shows_the_secret() -> None:
    key = generate_key()
    secret = parse_key(key.plaintext).secret
    assert secret not in repr(key)
    assert secret not in repr(parse_key(key.plaintext))


@pytest.mark.parametrize(
    "text",
    [
        "",
        "fi_",
        "sk-abcdef",
        "fi_short_" + "a" * 43,  # prefix of 5
        "fi_ABCDEFGH_" + "a" * 42,  # secret too short
        "fi_ABCDEFGH_" + "a" * 44,  # secret too long
        "fi_ABCDEFG!_" + "a" * 43,  # bad prefix character
        "fx_ABCDEFGH_" + "a" * 43,  # wrong marker
        "fi_ABCDEFGH_" + "a" * 42 + "\n",  # trailing newline
        " fi_ABCDEFGH_" + "a" * 43,
    ],
)
def test_malformed_keys_are_refused(text: str) -> None:
    assert not is_well_formed(text)
    with pytest.raises(InvalidKeyFormat):
        parse_key(text)


@given(st.text(max_size=80))
def test_parse_accepts_exactly_the_well_formed(text: str) -> None:
    if is_well_formed(text):
        assert parse_key(text).prefix == text[:11]
    else:
        with pytest.raises(InvalidKeyFormat):
            parse_key(text)
