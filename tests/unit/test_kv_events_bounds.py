"""What one KV-event message may cost the edge: caps checked from headers before decoding,
refused messages counted by reason and never partly applied, work done in slices, and events
attributed only to the one instance an endpoint belongs to."""

from __future__ import annotations

import asyncio
import time

import msgspec
import pytest
import zmq
import zmq.asyncio
from prometheus_client import CollectorRegistry

from regions.edge.policy.kv_event_format import (
    MAX_EVENTS_PER_BATCH,
    MAX_HASHES_PER_BATCH,
    MAX_HASHES_PER_EVENT,
    MAX_PAYLOAD_BYTES,
    MAX_SEQ,
    EventFormatError,
    check_frames,
    decode_batch,
    msgpack_length,
    run_steps,
)
from regions.edge.policy.prefix_index import PrefixIndex
from regions.edge.view import kv_events
from regions.edge.view.kv_events import (
    SLICE_S,
    EngineCache,
    KvEventHub,
    KvEventMetrics,
    KvEventSubscriber,
    endpoint_key,
    followed_endpoints,
    in_slices,
    read_steps,
)
from regions.tables.schema import Instance


def stored_map(hashes: list[int]) -> dict[str, object]:
    return {"type": "BlockStored", "block_hashes": hashes, "block_size": 16, "medium": "GPU"}


def batch(*events: object) -> bytes:
    return msgspec.msgpack.encode([1.0, list(events), 0])


def reason(payload: bytes) -> str:
    with pytest.raises(EventFormatError) as caught:
        decode_batch(payload)
    return caught.value.reason


@pytest.mark.parametrize("n", [0, 15, 16, 65535, 65536, 2**20])
def test_msgpack_length_reads_array_and_map_headers(n: int) -> None:
    assert msgpack_length(msgspec.msgpack.encode([0] * n)) == n
    assert msgpack_length(msgspec.msgpack.encode({str(k): 0 for k in range(min(n, 70000))})) == (
        min(n, 70000)
    )
    assert msgpack_length(b"\x05") is None and msgpack_length(b"") is None


def test_each_cap_refuses_the_message_with_its_reason() -> None:
    assert reason(b"\xc1\xc1") == "msgpack"
    assert reason(msgspec.msgpack.encode([1.0, "events"])) == "format"
    assert reason(msgspec.msgpack.encode([1.0, [{"type": "BlockStored", "block_size": 16}]])) == (
        "format"
    )
    assert reason(batch({**stored_map([1]), "medium": 7})) == "format"
    assert reason(batch({**stored_map([1]), "block_size": True})) == "format"
    assert reason(batch(stored_map([1] * (MAX_HASHES_PER_EVENT + 1)))) == "hashes"
    per_event = MAX_HASHES_PER_EVENT
    events = [stored_map([1] * per_event)] * (MAX_HASHES_PER_BATCH // per_event + 1)
    assert reason(batch(*events)) == "hashes"
    assert reason(batch(*[{"type": "AllBlocksCleared"}] * (MAX_EVENTS_PER_BATCH + 1))) == "events"
    assert reason(msgspec.msgpack.encode([None] * 1000)) == "format"  # no batch has 1000 fields
    assert reason(b"\x90" + b"\0" * (MAX_PAYLOAD_BYTES + 1)) == "frame_size"
    # at the caps, accepted
    ok = decode_batch(batch(stored_map([1] * per_event)))
    assert len(ok.events[0].hashes) == per_event  # type: ignore[union-attr]


def test_check_frames_bounds_frames_sizes_and_seq() -> None:
    payload = batch()
    assert check_frames([b"t", (7).to_bytes(8, "big"), payload]) == 7
    cases = [
        (([b"t", b"\0" * 8], None), "frames"),
        (([b"t", b"\0" * 8, payload], 100_000), "frames"),
        (([b"t" * 300, b"\0" * 8, payload], None), "frame_size"),
        (([b"t", b"\0" * 4, payload], None), "seq"),
        (([b"t", (MAX_SEQ + 1).to_bytes(8, "big"), payload], None), "seq"),
    ]
    for (frames, count), want in cases:
        with pytest.raises(EventFormatError) as caught:
            check_frames(frames, count)
        assert caught.value.reason == want


def subscriber(index: PrefixIndex | None = None) -> tuple[KvEventSubscriber, KvEventMetrics]:
    metrics = KvEventMetrics(CollectorRegistry())
    index = PrefixIndex() if index is None else index
    index.track("i-1")
    return KvEventSubscriber("i-1", "tcp://unused:1", index, 16.0, metrics), metrics


def msg(seq: int, payload: bytes) -> list[bytes]:
    return [b"kv-events", seq.to_bytes(8, "big"), payload]


def test_a_batch_over_a_cap_is_refused_whole_and_counted_not_partly_applied() -> None:
    sub, metrics = subscriber()
    sub.receive(msg(0, batch(stored_map([1, 2]))))
    assert sub.cache.tokens == 32 and sub.cache.known
    # a good event first, then one over the cap: neither is applied
    sub.receive(msg(1, batch(stored_map([3]), stored_map([4] * (MAX_HASHES_PER_EVENT + 1)))))
    assert set(sub.cache.blocks) == {1, 2}
    assert not sub.cache.known  # a message of the stream was not applied
    assert metrics.refused.labels("i-1", "hashes")._value.get() == 1
    assert metrics.engine_tokens.labels("i-1")._value.get() == -1
    assert metrics.batches.labels("i-1")._value.get() == 1
    # a clear in a refused batch forgets nothing of the prefix index
    sub.index.insert([10, 11], "i-1", 0.0)
    sub.receive(msg(2, batch({"type": "AllBlocksCleared"}, "not an event")))
    assert sub.index.held("i-1") == 2
    assert metrics.refused.labels("i-1", "format")._value.get() == 1


def test_a_store_past_the_resident_cap_is_not_applied(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kv_events, "MAX_RESIDENT_BLOCKS", 4)
    sub, metrics = subscriber()
    sub.receive(msg(0, batch(stored_map([1, 2, 3]))))
    sub.receive(msg(1, batch(stored_map([3]))))  # already held: fits
    assert sub.cache.known and sub.cache.tokens == 48
    sub.receive(msg(2, batch(stored_map([4, 5]))))
    assert sub.cache.blocks == {} and not sub.cache.known  # emptied, never 5 blocks
    assert metrics.refused.labels("i-1", "resident")._value.get() == 1


def test_engine_cache_applies_in_steps_between_events() -> None:
    cache = EngineCache()
    steps = cache.receive_steps(0, decode_batch(batch(stored_map([1]), stored_map([2]))))
    next(steps)
    assert set(cache.blocks) == {1}  # one event applied, the loop may run before the next
    next(steps)
    with pytest.raises(StopIteration):
        next(steps)
    assert set(cache.blocks) == {1, 2}


def test_in_slices_lets_other_tasks_run_during_a_long_message() -> None:
    ticks: list[int] = []
    seen: list[int] = []

    def work():  # type: ignore[no-untyped-def]
        for _ in range(5):
            time.sleep(SLICE_S * 1.5)  # each step spends the slice
            seen.append(len(ticks))
            yield
        return "done"

    async def ticker() -> None:
        while True:
            ticks.append(1)
            await asyncio.sleep(0)

    async def main() -> str:
        task = asyncio.create_task(ticker())
        await asyncio.sleep(0)
        try:
            return await in_slices(work())
        finally:
            task.cancel()

    assert asyncio.run(main()) == "done"
    assert seen == sorted(seen) and seen[-1] > seen[0]  # the ticker ran between steps


def test_read_steps_keeps_three_frames_and_drains_the_rest_in_chunks() -> None:
    ctx = zmq.Context()
    try:
        a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
        a.bind("inproc://frames")
        b.connect("inproc://frames")
        a.send_multipart([b"t", b"s", b"p", *[b"x"] * 4997])
        a.send_multipart([b"next", b"s", b"p"])
        assert b.poll(1000)
        steps = read_steps(b)
        yields = 0
        while True:
            try:
                next(steps)
                yields += 1
            except StopIteration as stop:
                frames, count = stop.value
                break
        assert frames == [b"t", b"s", b"p"] and count == 5000 and yields == 4
        # the next message starts where it should
        frames, count = run_steps(read_steps(b))
        assert frames[0] == b"next" and count == 3
        a.close()
        b.close()
    finally:
        ctx.term()


def inst(name: str, endpoint: str | None) -> Instance:
    return Instance(id=name, url=f"http://{name}:8000", model="m", kv_events_endpoint=endpoint)


def test_an_endpoint_named_for_two_instances_is_followed_for_neither() -> None:
    assert endpoint_key("TCP://[::ffff:10.0.0.5]:5557") == "tcp://10.0.0.5:5557"
    instances = [
        inst("a", "tcp://10.0.0.5:5557"),
        inst("b", "tcp://[::ffff:10.0.0.5]:5557"),  # the same socket, spelled otherwise
        inst("c", "tcp://10.0.0.6:5557"),
        inst("d", None),
    ]
    assert followed_endpoints(instances) == {"c": "tcp://10.0.0.6:5557"}
    registry = CollectorRegistry()
    hub = KvEventHub(PrefixIndex(), 16.0, registry)
    hub.sync(instances)
    assert registry.get_sample_value("fedinfer_edge_kv_event_shared_endpoints") == 2
    assert hub.index.held("c") == 0
    with pytest.raises(KeyError):
        hub.index.held("a")  # not tracked: nothing of it is corrected by anyone's events


class CountingIndex(PrefixIndex):
    """A prefix index that counts how often one instance's entries are scanned for."""

    def __init__(self) -> None:
        super().__init__()
        self.forgets = 0

    def forget_instance(self, instance: str) -> None:
        self.forgets += 1
        super().forget_instance(instance)


def test_a_publisher_clearing_in_a_loop_scans_the_index_once_per_interval() -> None:
    index = CountingIndex()
    sub, _ = subscriber(index)
    index.insert([1, 2], "i-1", 0.0)
    for seq in range(100):  # each one a clear, or a restart (seq 0 again)
        sub.receive(msg(seq if seq % 2 else 0, batch({"type": "AllBlocksCleared"})))
    assert index.forgets == 1 and index.held("i-1") == 0  # the first at once
    index.insert([3], "i-1", 0.0)
    sub.maintain(time.monotonic())  # within the interval: nothing
    assert index.forgets == 1
    sub.maintain(time.monotonic() + kv_events.INDEX_SCAN_INTERVAL_S)
    assert index.forgets == 2 and index.held("i-1") == 0  # the later clears, forgotten once


def test_loop_budget_pauses_a_subscription_past_its_share_until_the_window_ends() -> None:
    budget = kv_events.LoopBudget(share=0.1, window_s=1.0)
    budget.charge(0.05, now=10.0)
    assert budget.pause(10.2) == 0.0
    budget.charge(0.06, now=10.3)  # 0.11 s of loop time in this window
    assert budget.pause(10.4) == pytest.approx(0.6)
    assert budget.pause(11.0) == 0.0  # the window is over
    budget.charge(0.01, now=11.1)  # a new window
    assert budget.spent == pytest.approx(0.01) and budget.pause(11.2) == 0.0


def test_a_flood_of_small_messages_is_throttled_not_read_as_fast_as_it_comes() -> None:
    """10 000 garbage messages over inproc: the subscriber stops reading once its share of
    the loop is spent, so fewer are even looked at than were sent."""

    async def main() -> tuple[float, float]:
        actx = zmq.asyncio.Context()
        pub = actx.socket(zmq.XPUB)
        pub.setsockopt(zmq.SNDHWM, 0)
        pub.bind("inproc://flood")
        sub, metrics = subscriber()
        sub.endpoint = "inproc://flood"
        sub.budget = kv_events.LoopBudget(share=0.01, window_s=1.0)
        task = asyncio.create_task(sub.run(actx))
        try:
            await asyncio.wait_for(pub.recv(), 10)  # the subscription
            for _ in range(10_000):
                await pub.send_multipart(msg(1, b"\xc1"))
            deadline = time.monotonic() + 20
            while metrics.throttled.labels("i-1")._value.get() < 1:
                assert time.monotonic() < deadline, "never throttled"
                await asyncio.sleep(0.05)
            return (
                metrics.refused.labels("i-1", "msgpack")._value.get(),
                metrics.throttled.labels("i-1")._value.get(),
            )
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            pub.close(linger=0)
            actx.destroy(linger=0)

    seen, throttled = asyncio.run(main())
    assert throttled >= 1 and 0 < seen < 10_000
