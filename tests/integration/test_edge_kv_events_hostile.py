"""A hostile KV-event publisher against a real edge, on loopback.

The table names an XPUB socket of this test as the ``kv_events_endpoint`` of a simulated
engine's instance (a compromised engine, as far as the edge can tell). It sends what no vLLM
sends: garbage msgpack, wrong types, an absurd ``seq``, 10^6 block hashes in one event, 40 000
events in one batch, a message of 100 000 frames and one of 64 MiB. The edge keeps serving
(a chat answers promptly, ``/healthz`` answers), counts each by reason, applies none of them,
and the subscription survives: libzmq drops the connection that sent 64 MiB (``ZMQ_MAXMSGSIZE``)
and reconnects, and a well-formed batch from the same publisher is applied afterwards.
XPUB (a PUB that also hears subscriptions) tells the test when the edge has (re)subscribed.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import zmq

from regions.engines.simulator.kv_events import BlockStored, KVEventBatch
from regions.supervisor import wait_until
from tests.integration.test_edge_support import EdgeProc, engine_sims, start_edge, table_doc

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
INSTANCE = "sim-0"


@dataclass
class Setup:
    edge: EdgeProc
    publisher: zmq.Socket[bytes]


def subscribed(publisher: zmq.Socket[bytes], timeout_s: float = 30.0) -> None:
    """Wait for the edge's SUB socket to (re)subscribe: XPUB hears ``\\x01`` + topic (and
    ``\\x00`` + topic when a connection that had subscribed is gone)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if publisher.poll(100) and publisher.recv()[:1] == b"\x01":
            return
    raise AssertionError("the edge never subscribed")


@pytest.fixture
def setup(tmp_path: Path) -> Iterator[Setup]:
    ctx = zmq.Context()
    publisher: zmq.Socket[bytes] = ctx.socket(zmq.XPUB)
    publisher.setsockopt(zmq.XPUB_VERBOSE, 1)  # hear every subscription, repeats included
    publisher.setsockopt(zmq.LINGER, 0)
    publisher.bind("tcp://127.0.0.1:0")
    endpoint = publisher.getsockopt_string(zmq.LAST_ENDPOINT)
    try:
        with engine_sims(tmp_path, 1, MODEL, "--max-model-len", "1024") as engines:
            inst: dict[str, Any] = {
                "id": INSTANCE,
                "url": engines[0]["url"],
                "model": MODEL,
                "kv_events_endpoint": endpoint,
            }
            edge = start_edge(tmp_path, table_doc("kvh", 1, [inst]))
            try:
                subscribed(publisher)
                yield Setup(edge, publisher)
            finally:
                edge.proc.stop()
    finally:
        publisher.close(linger=0)
        ctx.term()


def message(seq: int, payload: bytes) -> list[bytes]:
    return [b"kv-events", seq.to_bytes(8, "big"), payload]


def stored(*hashes: int) -> bytes:
    event = BlockStored(
        block_hashes=list(hashes),
        parent_block_hash=None,
        token_ids=[1] * (16 * len(hashes)),
        block_size=16,
        lora_id=None,
        medium="GPU",
        lora_name=None,
    )
    return msgspec.msgpack.encode(KVEventBatch(ts=time.time(), events=[event]))


def series(edge: EdgeProc, name: str, **labels: str) -> float | None:
    """One sample of the edge's /metrics (None: not there)."""
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in httpx.get(edge.ops + "/metrics", timeout=5).text.splitlines():
        key, _, value = line.rpartition(" ")
        metric, _, rest = key.partition("{")
        if metric == name and ",".join(sorted(rest.rstrip("}").split(","))) == want:
            return float(value)
    return None


def refused(edge: EdgeProc, reason: str) -> float:
    return (
        series(edge, "fedinfer_edge_kv_event_refused_total", instance=INSTANCE, reason=reason) or 0
    )


def cached_tokens(edge: EdgeProc) -> float | None:
    return series(edge, "fedinfer_edge_kv_engine_cached_tokens", instance=INSTANCE)


def chat_seconds(edge: EdgeProc) -> float:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}
    started = time.monotonic()
    r = httpx.post(edge.url + "/v1/chat/completions", json=body, timeout=10)
    r.raise_for_status()
    assert httpx.get(edge.ops + "/healthz", timeout=5).status_code == 200
    return time.monotonic() - started


def test_a_hostile_publisher_is_refused_counted_and_cannot_stall_the_edge(setup: Setup) -> None:
    edge, pub = setup.edge, setup.publisher
    pub.send_multipart(message(0, stored(1, 2, 3, 4)))
    wait_until(lambda: cached_tokens(edge) == 64, what="a well-formed batch applied")

    hostile = {
        "msgpack": [message(1, b"\xc1\xc1\xc1")],
        "format": [message(2, msgspec.msgpack.encode([1.0, "not events"]))],
        "seq": [message(2**64 - 1, stored(5))],
        "hashes": [
            message(
                3,
                msgspec.msgpack.encode(
                    [
                        1.0,
                        [
                            {
                                "type": "BlockStored",
                                "block_hashes": [k % 100 for k in range(10**6)],
                                "block_size": 16,
                                "medium": "GPU",
                            }
                        ],
                    ]
                ),
            )
        ],
        "events": [
            message(4, msgspec.msgpack.encode([1.0, [{"type": "AllBlocksCleared"}] * 40_000]))
        ],
        "frames": [[b"x"] * 100_000],
    }
    for messages in hostile.values():
        for frames in messages:
            pub.send_multipart(frames)
    assert chat_seconds(edge) < 3.0
    for reason in hostile:
        wait_until(lambda r=reason: refused(edge, r) >= 1, what=f"a message refused for {reason}")
    # Nothing of them was applied: no 10^6 blocks, no clear; the set is unknown (-1) from the
    # first refusal, the one accepted batch is still the only one.
    assert cached_tokens(edge) == -1
    assert series(edge, "fedinfer_edge_kv_event_batches_total", instance=INSTANCE) == 1

    # 64 MiB: libzmq drops the connection at the frame's header and reconnects.
    pub.send_multipart(message(5, b"\0" * (64 << 20)))
    wait_until(
        lambda: (
            (series(edge, "fedinfer_edge_kv_event_disconnects_total", instance=INSTANCE) or 0) >= 1
        ),
        what="the oversized sender disconnected",
    )
    assert chat_seconds(edge) < 3.0
    subscribed(pub)  # the edge connected and subscribed again

    # The subscription survived: a restarted stream (seq 0) from the same publisher applies.
    pub.send_multipart(message(0, stored(10, 11, 12, 13, 14, 15, 16, 17)))
    wait_until(lambda: cached_tokens(edge) == 128, what="a well-formed batch after the attacks")
    assert series(edge, "fedinfer_edge_kv_event_batches_total", instance=INSTANCE) == 2
