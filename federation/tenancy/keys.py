"""API key (and API token) material. Pure, no Django.

A key reads ``fi_<prefix>_<secret>``: the 8-character prefix is stored in clear so people can
tell their keys apart; the secret carries 256 bits from ``secrets``. Only the SHA-256 of the
whole key is stored, and the edge authenticates a request by looking that hash up in its
routing table, so a stolen database or table never yields a usable key.
"""

from __future__ import annotations

import re
import secrets
import string
from dataclasses import dataclass

from regions.tables.schema import key_hash

KEY_PREFIX = "fi"
#: People's API tokens (``POST /auth/token/``) read ``ft_<prefix>_<secret>``, the same shape.
TOKEN_PREFIX = "ft"
#: Edge credentials read ``fe_<secret>``: the prefix tells them apart from staff tokens. Only
#: their hash is stored (``hash_key``, as for API keys).
EDGE_CREDENTIAL_PREFIX = "fe_"
PREFIX_LENGTH = 8
SECRET_BYTES = 32  # 256 bits
_PREFIX_ALPHABET = string.ascii_letters + string.digits
# token_urlsafe(32) is 43 characters of the URL-safe base64 alphabet.
_KEY_RE = re.compile(r"^fi_(?P<prefix>[A-Za-z0-9]{8})_(?P<secret>[A-Za-z0-9_-]{43})$")
_TOKEN_RE = re.compile(r"^ft_[A-Za-z0-9]{8}_[A-Za-z0-9_-]{43}$")


class InvalidKeyFormat(ValueError):
    """The text is not shaped like a fedinfer API key."""


@dataclass(frozen=True, slots=True)
class GeneratedKey:
    plaintext: str
    prefix: str  # "fi_AbC123xY": what lists show
    key_hash: str

    def __repr__(self) -> str:  # never leak the secret into logs or tracebacks
        return f"GeneratedKey(prefix={self.prefix!r})"


@dataclass(frozen=True, slots=True)
class ParsedKey:
    prefix: str  # "fi_AbC123xY"
    secret: str

    def __repr__(self) -> str:
        return f"ParsedKey(prefix={self.prefix!r})"


def hash_key(plaintext: str) -> str:
    """SHA-256 hex of the whole key: what is stored and what the edge looks up (the table
    contract's :func:`~regions.tables.schema.key_hash`)."""
    return key_hash(plaintext.encode("utf-8"))


def generate_key(kind: str = KEY_PREFIX) -> GeneratedKey:
    """A new key (``kind`` ``fi``) or token (``kind`` ``ft``)."""
    prefix = "".join(secrets.choice(_PREFIX_ALPHABET) for _ in range(PREFIX_LENGTH))
    plaintext = f"{kind}_{prefix}_{secrets.token_urlsafe(SECRET_BYTES)}"
    return GeneratedKey(
        plaintext=plaintext, prefix=f"{kind}_{prefix}", key_hash=hash_key(plaintext)
    )


def parse_key(text: str) -> ParsedKey:
    """Split a key into its visible prefix and secret; ``InvalidKeyFormat`` if malformed."""
    match = _KEY_RE.fullmatch(text)
    if match is None:
        raise InvalidKeyFormat("not a fedinfer API key (expected fi_<8 characters>_<secret>)")
    return ParsedKey(prefix=f"{KEY_PREFIX}_{match['prefix']}", secret=match["secret"])


def is_well_formed(text: str) -> bool:
    return _KEY_RE.fullmatch(text) is not None


def is_well_formed_token(text: str) -> bool:
    """Shaped like a token ``generate_key(TOKEN_PREFIX)`` makes (checked before any lookup)."""
    return _TOKEN_RE.fullmatch(text) is not None
