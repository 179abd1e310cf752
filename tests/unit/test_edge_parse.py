"""Request parsing (only what routing needs) and the SSE usage tap (byte-exact pass-through)."""

from __future__ import annotations

import orjson
import pytest

from regions.edge.errors import EdgeError
from regions.edge.parse import UsageTap, body_usage, parse_request


def chat(**kw: object) -> bytes:
    base: dict[str, object] = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    base.update(kw)
    return orjson.dumps(base)


def test_chat_request_renders_the_messages_in_order() -> None:
    p = parse_request(
        chat(
            messages=[
                {"role": "system", "content": "S"},
                {"role": "user", "content": [{"type": "text", "text": "U"}]},
            ],
            user="u-1",
        ),
        chat=True,
        bytes_per_token=4.0,
    )
    assert p.model == "m" and p.prompt == b"system\nS\n\nuser\nU\n\n"
    assert p.user == "u-1" and not p.stream and not p.strip_usage
    assert p.prompt_tokens == len(p.prompt) // 4 + 1


def test_non_streaming_body_is_forwarded_untouched() -> None:
    raw = chat()
    assert parse_request(raw, chat=True, bytes_per_token=4.0).body is raw


def test_stream_gets_include_usage_and_remembers_to_strip_it() -> None:
    p = parse_request(chat(stream=True), chat=True, bytes_per_token=4.0)
    assert p.stream and p.strip_usage
    assert orjson.loads(p.body)["stream_options"] == {"include_usage": True}
    raw = chat(stream=True, stream_options={"include_usage": True})
    asked = parse_request(raw, chat=True, bytes_per_token=4.0)
    assert asked.body is raw and not asked.strip_usage


def test_completion_prompts() -> None:
    text = parse_request(b'{"model":"m","prompt":"abcd"}', chat=False, bytes_per_token=4.0)
    assert text.prompt == b"abcd"
    ids = parse_request(b'{"model":"m","prompt":[1,2,3]}', chat=False, bytes_per_token=4.0)
    assert ids.prompt_tokens == 3 and len(ids.prompt) == 12


@pytest.mark.parametrize(
    ("raw", "chat_", "code", "param"),
    [
        (b"{oops", True, "invalid_json", None),
        (b"[1]", True, "invalid_json", None),
        (b'{"messages":[{"role":"user","content":"x"}]}', True, "missing_model", "model"),
        (b'{"model":"m"}', True, "missing_messages", "messages"),
        (b'{"model":"m","messages":[]}', True, "missing_messages", "messages"),
        (b'{"model":"m","messages":["x"]}', True, "invalid_request", "messages"),
        (b'{"model":"m"}', False, "missing_prompt", "prompt"),
        (b'{"model":"m","prompt":[-1]}', False, "invalid_request", "prompt"),
    ],
)
def test_bad_requests_are_400_with_a_reason(
    raw: bytes, chat_: bool, code: str, param: str | None
) -> None:
    with pytest.raises(EdgeError) as info:
        parse_request(raw, chat=chat_, bytes_per_token=4.0)
    assert info.value.status == 400
    assert info.value.code == code and info.value.param == param
    err = orjson.loads(info.value.body())["error"]
    assert set(err) == {"message", "type", "param", "code"}


CHUNK = b'data: {"id":"c","choices":[{"index":0,"delta":{"content":"hi"}}]}\n\n'
USAGE = (
    b'data: {"id":"c","choices":[],"usage":{"prompt_tokens":40,"completion_tokens":2,'
    b'"prompt_tokens_details":{"cached_tokens":32}}}\n\n'
)
DONE = b"data: [DONE]\n\n"


def feed_all(tap: UsageTap, data: bytes, step: int) -> bytes:
    out = b"".join(tap.feed(data[i : i + step]) for i in range(0, len(data), step))
    return out + tap.pending


@pytest.mark.parametrize("step", [1, 7, 64, 10_000])
def test_tap_passes_the_stream_byte_for_byte_and_reads_usage(step: int) -> None:
    stream = CHUNK * 3 + USAGE + DONE
    tap = UsageTap(strip=False)
    assert feed_all(tap, stream, step) == stream
    assert tap.done and tap.prompt_tokens == 40 and tap.cached_tokens == 32


@pytest.mark.parametrize("step", [1, 13, 10_000])
def test_tap_strips_the_usage_chunk_it_asked_for(step: int) -> None:
    tap = UsageTap(strip=True)
    assert feed_all(tap, CHUNK * 2 + USAGE + DONE, step) == CHUNK * 2 + DONE
    assert tap.cached_tokens == 32


def test_tap_holds_a_partial_event_and_notices_a_cut_stream() -> None:
    tap = UsageTap(strip=False)
    assert tap.feed(CHUNK[:10]) == b""
    assert tap.feed(CHUNK[10:] + CHUNK[:5]) == CHUNK
    assert not tap.done


def test_body_usage() -> None:
    assert body_usage(b'{"usage":{"prompt_tokens":5,"prompt_tokens_details":null}}') == (5, None)
    assert body_usage(b'{"choices":[]}') == (None, None)
