"""The wire format of vLLM's KV-cache events, checked and decoded. Pure: bytes in, a
:class:`Batch` or an :class:`EventFormatError` out (``kv_events.py`` subscribes and applies).

A message is ``[topic, seq, payload]``: ``seq`` 8-byte big-endian, ``payload`` msgpack of a
``KVEventBatch`` (``[ts, events, data_parallel_rank]``, each event ``BlockStored``,
``BlockRemoved`` or ``AllBlocksCleared``, in vLLM's array or map form). The publisher is not
authenticated, so what a message may cost is bounded whatever it says: sizes, frames, events
and hashes are checked from headers before anything is decoded (the ``MAX_*`` caps), and the
decoding is a generator of steps (:func:`decode_steps`) the caller runs in slices.
"""

from __future__ import annotations

from collections.abc import Generator, Hashable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec

from regions.engines.block_hash import event_int

_T = TypeVar("_T")

#: What one message may carry: beyond any of these it is refused whole and counted (reason in
#: brackets), never partly applied. vLLM publishes one batch per engine step, whose new blocks are
#: bounded by the step's batched tokens (a few thousand blocks); the caps leave a wide margin
#: and bound what a hostile or broken publisher costs the edge per message.
#: Bytes of a payload frame [frame_size]; also ``ZMQ_MAXMSGSIZE`` on the SUB socket: libzmq
#: drops a connection that sends a larger frame before reading it, and reconnects.
MAX_PAYLOAD_BYTES = 2 << 20
#: Bytes of the topic frame [frame_size] (vLLM's topic is the configured string, e.g. "kv-events").
MAX_TOPIC_BYTES = 256
#: Frames of a message: vLLM sends exactly ``[topic, seq, payload]`` [frames].
FRAMES = 3
#: The largest ``seq``: vLLM counts from 0 per process; 2^63 and beyond is no sequence [seq].
MAX_SEQ = (1 << 63) - 1
#: Events in one batch [events], block hashes in one event and in one batch [hashes].
MAX_EVENTS_PER_BATCH = 1 << 13
MAX_HASHES_PER_EVENT = 1 << 14
MAX_HASHES_PER_BATCH = 1 << 16
#: Fields of a batch or of an array-form event (vLLM has 3 and 7 today, appended ones allowed).
_MAX_FIELDS = 32


class EventFormatError(ValueError):
    """A message that is not a vLLM ``KVEventBatch`` or exceeds a cap; ``reason`` names which
    (the label of ``fedinfer_edge_kv_event_refused``)."""

    def __init__(self, detail: str, reason: str = "format") -> None:
        super().__init__(detail)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class Stored:
    hashes: tuple[Hashable, ...]
    block_size: int
    medium: str | None


@dataclass(frozen=True, slots=True)
class Removed:
    hashes: tuple[Hashable, ...]
    medium: str | None


@dataclass(frozen=True, slots=True)
class Cleared:
    pass


Event = Stored | Removed | Cleared


@dataclass(frozen=True, slots=True)
class Batch:
    ts: float
    events: tuple[Event, ...]
    data_parallel_rank: int | None = None


class _MapEvent(msgspec.Struct):
    """An event in vLLM 0.32's map form, only the fields the edge reads: the rest (token ids,
    extra keys) is skipped by the decoder without being built."""

    type: str = ""
    block_hashes: msgspec.Raw = msgspec.Raw()
    block_size: msgspec.Raw = msgspec.Raw()
    medium: msgspec.Raw = msgspec.Raw()


class _MapBatch(msgspec.Struct):
    ts: msgspec.Raw = msgspec.Raw()
    events: msgspec.Raw = msgspec.Raw()
    data_parallel_rank: msgspec.Raw = msgspec.Raw()


_RawList = list[msgspec.Raw]
_decode_batch = msgspec.msgpack.Decoder(_RawList | _MapBatch).decode
_decode_whole = msgspec.msgpack.Decoder(msgspec.Raw).decode
_decode_raws = msgspec.msgpack.Decoder(_RawList).decode
_decode_event = msgspec.msgpack.Decoder(_MapEvent | _RawList).decode
_decode_hashes = msgspec.msgpack.Decoder(list[int | bytes]).decode
_decode_ts = msgspec.msgpack.Decoder(float).decode
_decode_int = msgspec.msgpack.Decoder(int).decode
_decode_str = msgspec.msgpack.Decoder(str | None).decode
_decode_rank = msgspec.msgpack.Decoder(int | None).decode


def msgpack_length(raw: bytes | memoryview | msgspec.Raw) -> int | None:
    """The element count of a msgpack array or map from its header alone (None: neither), so
    a count is checked before anything is built from it."""
    view = memoryview(raw)
    if not view:
        return None
    head = view[0]
    if 0x80 <= head <= 0x9F:  # fixmap, fixarray
        return head & 0x0F
    if head in (0xDC, 0xDE) and len(view) >= 3:  # array 16, map 16
        return int.from_bytes(view[1:3], "big")
    if head in (0xDD, 0xDF) and len(view) >= 5:  # array 32, map 32
        return int.from_bytes(view[1:5], "big")
    return None


def _decoded(decode: Any, raw: msgspec.Raw | bytes, what: str) -> Any:
    try:
        return decode(raw)
    except msgspec.DecodeError as exc:  # ValidationError included
        raise EventFormatError(f"{what}: {exc}") from None


def _hashes(raw: msgspec.Raw) -> tuple[Hashable, ...]:
    """Event hashes as ints: vLLM sends the last 8 bytes as an int by default, the whole
    digest as bytes under ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``; both become the int.
    The count is checked from the array header, before any hash is decoded."""
    n = msgpack_length(raw)
    if n is not None and n > MAX_HASHES_PER_EVENT:
        raise EventFormatError(f"{n} block hashes in one event", "hashes")
    values = _decoded(_decode_hashes, raw, "block_hashes must be a list of ints or bytes")
    return tuple(event_int(h) if isinstance(h, bytes) else h for h in values)


def _medium(raw: msgspec.Raw) -> str | None:
    return _decoded(_decode_str, raw, "medium must be a string") if len(raw) else None


def _block_size(raw: msgspec.Raw, tag: str) -> int:
    size = _decoded(_decode_int, raw, "block_size must be an int") if len(raw) else None
    if size is None or size < 1:
        raise EventFormatError(f"{tag} without a block_size")
    return int(size)


def decode_event(raw: msgspec.Raw | bytes) -> Event | None:
    """One event: a map tagged by ``type`` (vLLM 0.32) or an array ``[tag, fields...]``
    (releases whose events were ``array_like``); None for an event type not known here."""
    n = msgpack_length(raw)
    if n is None or n > _MAX_FIELDS:
        raise EventFormatError("an event must be a map or an array of a few fields")
    parsed = _decoded(_decode_event, raw, "malformed event")
    if isinstance(parsed, _MapEvent):
        tag = parsed.type
        if tag == "BlockStored":
            size = _block_size(parsed.block_size, tag)
            if not len(parsed.block_hashes):
                raise EventFormatError("BlockStored without block_hashes")
            return Stored(_hashes(parsed.block_hashes), size, _medium(parsed.medium))
        if tag == "BlockRemoved":
            if not len(parsed.block_hashes):
                raise EventFormatError("BlockRemoved without block_hashes")
            return Removed(_hashes(parsed.block_hashes), _medium(parsed.medium))
    else:
        if not parsed:
            raise EventFormatError("an array event must be [tag, fields...]")
        tag = _decoded(_decode_str, parsed[0], "an event's tag must be a string") or ""
        if tag == "BlockStored" and len(parsed) >= 5:
            medium = _medium(parsed[6]) if len(parsed) > 6 else None
            return Stored(_hashes(parsed[1]), _block_size(parsed[4], tag), medium)
        if tag == "BlockRemoved" and len(parsed) >= 2:
            medium = _medium(parsed[2]) if len(parsed) > 2 else None
            return Removed(_hashes(parsed[1]), medium)
    if tag == "AllBlocksCleared":
        return Cleared()
    if tag in ("BlockStored", "BlockRemoved"):
        raise EventFormatError(f"malformed {tag}")
    return None


def split_batch(payload: bytes | memoryview) -> tuple[float, list[msgspec.Raw], int | None]:
    """A ``KVEventBatch``'s timestamp, undecoded events and rank; every count is checked
    from its header before the list is built."""
    if len(payload) > MAX_PAYLOAD_BYTES:
        raise EventFormatError(f"payload of {len(payload)} bytes", "frame_size")
    n = msgpack_length(payload)
    if n is None or n > _MAX_FIELDS:
        try:
            _decode_whole(payload)  # skimmed only to tell garbage from a wrong type
        except msgspec.DecodeError as exc:
            raise EventFormatError(f"not msgpack: {exc}", "msgpack") from None
        raise EventFormatError("a batch must be [ts, events, ...]")
    try:
        raw = _decode_batch(payload)
    except msgspec.ValidationError as exc:
        raise EventFormatError(f"a batch must be [ts, events, ...]: {exc}") from None
    except msgspec.DecodeError as exc:
        raise EventFormatError(f"not msgpack: {exc}", "msgpack") from None
    if isinstance(raw, _MapBatch):
        ts_raw, events_raw, rank_raw = raw.ts, raw.events, raw.data_parallel_rank
    elif len(raw) >= 2:
        ts_raw, events_raw = raw[0], raw[1]
        rank_raw = raw[2] if len(raw) > 2 else msgspec.Raw()
    else:
        raise EventFormatError("a batch must be [ts, events, ...]")
    if not len(ts_raw) or not len(events_raw):
        raise EventFormatError("a batch must be [ts, events, ...]")
    ts = _decoded(_decode_ts, ts_raw, "a batch's ts must be a number")
    count = msgpack_length(events_raw)
    if count is not None and count > MAX_EVENTS_PER_BATCH:
        raise EventFormatError(f"{count} events in one batch", "events")
    events = _decoded(_decode_raws, events_raw, "a batch's events must be a list")
    try:
        rank = _decode_rank(rank_raw) if len(rank_raw) else None
    except msgspec.DecodeError:
        rank = None  # informational only
    return float(ts), events, rank


def decode_steps(payload: bytes | memoryview) -> Generator[None, None, Batch]:
    """Decode a batch one event at a time, yielding between events (the subscriber returns
    to the event loop when its slice is spent); :class:`EventFormatError` when the payload is
    not a batch or exceeds a cap, before anything of it is applied."""
    ts, raws, rank = split_batch(payload)
    parsed: list[Event] = []
    hashes = 0
    for raw in raws:
        event = decode_event(raw)
        if event is not None:
            if not isinstance(event, Cleared):
                hashes += len(event.hashes)
                if hashes > MAX_HASHES_PER_BATCH:
                    raise EventFormatError(f"over {MAX_HASHES_PER_BATCH} hashes", "hashes")
            parsed.append(event)
        yield
    return Batch(ts, tuple(parsed), rank)


def run_steps(steps: Generator[None, None, _T]) -> _T:
    """Run a step generator to its end at once (tests, and callers off the event loop)."""
    while True:
        try:
            next(steps)
        except StopIteration as stop:
            return stop.value  # type: ignore[no-any-return]


def decode_batch(payload: bytes | memoryview) -> Batch:
    """Decode a ``KVEventBatch`` payload; :class:`EventFormatError` when it is not one.

    Decoded from plain msgpack rather than into vLLM's Structs, so fields added by later
    releases (they are appended, with defaults) and unknown event types are skipped.
    """
    return run_steps(decode_steps(payload))


def check_frames(frames: Sequence[bytes], count: int | None = None) -> int:
    """The ``seq`` of a ``[topic, seq, payload]`` message (``count``: frames the message had,
    when more were drained than kept); :class:`EventFormatError` otherwise."""
    total = len(frames) if count is None else count
    if total != FRAMES:
        raise EventFormatError(f"{total} frames, not [topic, seq, payload]", "frames")
    topic, seq, payload = frames
    if len(topic) > MAX_TOPIC_BYTES or len(payload) > MAX_PAYLOAD_BYTES:
        raise EventFormatError("a frame over its size cap", "frame_size")
    if len(seq) != 8:
        raise EventFormatError("seq is not 8 bytes", "seq")
    value = int.from_bytes(seq, "big")
    if value > MAX_SEQ:
        raise EventFormatError(f"seq {value}", "seq")
    return value
