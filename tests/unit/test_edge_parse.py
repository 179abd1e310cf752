"""Request parsing (only what routing needs) and the SSE usage tap (byte-exact pass-through)."""

from __future__ import annotations

import orjson
import pytest

from regions.edge.http.endpoints import CHAT, COMPLETIONS
from regions.edge.http.errors import EdgeError
from regions.edge.http.parse import (
    DEFAULT_OUTPUT_TOKENS,
    EDGE_ONLY_FIELDS,
    MAX_CHOICES,
    MAX_CLIENT_SALT,
    MEDIA_PART_TOKENS,
    UsageTap,
    body_usage,
    parse_request,
    with_cache_salt,
)


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
        endpoint=CHAT,
        bytes_per_token=4.0,
    )
    assert p.model == "m" and p.prompt == b"system\nS\n\nuser\nU\n\n"
    assert p.user == "u-1" and not p.stream and not p.strip_usage
    assert p.prompt_tokens == len(p.prompt) // 4 + 1


def test_non_streaming_body_is_forwarded_untouched() -> None:
    raw = chat()
    assert parse_request(raw, endpoint=CHAT, bytes_per_token=4.0).body is raw


def test_stream_gets_include_usage_and_remembers_to_strip_it() -> None:
    p = parse_request(chat(stream=True), endpoint=CHAT, bytes_per_token=4.0)
    assert p.stream and p.strip_usage
    assert orjson.loads(p.body)["stream_options"] == {"include_usage": True}
    raw = chat(stream=True, stream_options={"include_usage": True})
    asked = parse_request(raw, endpoint=CHAT, bytes_per_token=4.0)
    assert asked.body is raw and not asked.strip_usage


def test_completion_prompts() -> None:
    text = parse_request(
        b'{"model":"m","prompt":"abcd"}', endpoint=COMPLETIONS, bytes_per_token=4.0
    )
    assert text.prompt == b"abcd"
    ids = parse_request(
        b'{"model":"m","prompt":[1,2,3]}', endpoint=COMPLETIONS, bytes_per_token=4.0
    )
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
        parse_request(raw, endpoint=CHAT if chat_ else COMPLETIONS, bytes_per_token=4.0)
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
    assert body_usage(b'{"usage":{"prompt_tokens":5,"prompt_tokens_details":null}}') == (
        5, None, None,
    )  # fmt: skip
    assert body_usage(b'{"usage":{"prompt_tokens":5,"completion_tokens":3}}') == (5, None, 3)
    assert body_usage(b'{"choices":[]}') == (None, None, None)


def test_tap_reads_completion_tokens() -> None:
    tap = UsageTap(strip=True)
    feed_all(tap, CHUNK + USAGE + DONE, 9)
    assert (tap.prompt_tokens, tap.completion_tokens) == (40, 2)


@pytest.mark.parametrize("field", EDGE_ONLY_FIELDS)
def test_fields_only_the_edge_may_set_are_refused(field: str) -> None:
    """A client's ``kv_transfer_params`` would point an engine at another request's KV blocks;
    ``priority`` would jump every other tenant's queue; ``request_id`` could collide."""
    for raw, chat_ in (
        (chat(**{field: {"do_remote_prefill": True}}), True),
        (orjson.dumps({"model": "m", "prompt": "x", field: 1}), False),
    ):
        with pytest.raises(EdgeError) as info:
            parse_request(raw, endpoint=CHAT if chat_ else COMPLETIONS, bytes_per_token=4.0)
        assert (info.value.status, info.value.code, info.value.param) == (
            400, "edge_only_field", field,
        )  # fmt: skip


def test_cost_counts_every_choice_and_the_output_limit() -> None:
    plain = parse_request(chat(max_tokens=100), endpoint=CHAT, bytes_per_token=4.0)
    assert plain.max_output_tokens == 100
    assert plain.cost_tokens == plain.prompt_tokens + 100
    n4 = parse_request(chat(max_tokens=100, n=4), endpoint=CHAT, bytes_per_token=4.0)
    assert n4.max_output_tokens == 400
    newer = parse_request(chat(max_completion_tokens=50, n=2), endpoint=CHAT, bytes_per_token=4.0)
    assert newer.max_output_tokens == 100
    best = parse_request(
        orjson.dumps({"model": "m", "prompt": "x", "best_of": 3, "max_tokens": 10}),
        endpoint=COMPLETIONS,
        bytes_per_token=4.0,
    )
    assert best.max_output_tokens == 30
    unlimited = parse_request(chat(), endpoint=CHAT, bytes_per_token=4.0)
    assert unlimited.max_output_tokens == DEFAULT_OUTPUT_TOKENS


def test_cost_counts_images_and_tool_schemas_in_the_prompt() -> None:
    text_only = parse_request(chat(), endpoint=CHAT, bytes_per_token=4.0)
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + "A" * 9000}}
    with_images = parse_request(
        chat(
            messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}, image, image]}]
        ),
        endpoint=CHAT,
        bytes_per_token=4.0,
    )
    assert with_images.prompt_tokens == text_only.prompt_tokens + 2 * MEDIA_PART_TOKENS
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"a": "b" * 400}}}]
    with_tools = parse_request(chat(tools=tools), endpoint=CHAT, bytes_per_token=4.0)
    assert with_tools.prompt_tokens >= text_only.prompt_tokens + 100


@pytest.mark.parametrize(
    "extra",
    [{"n": 0}, {"n": "2"}, {"n": MAX_CHOICES + 1}, {"max_tokens": -1}, {"max_tokens": True}],
)
def test_bad_output_limits_are_refused(extra: dict[str, object]) -> None:
    with pytest.raises(EdgeError) as info:
        parse_request(chat(**extra), endpoint=CHAT, bytes_per_token=4.0)
    assert info.value.status == 400


def test_cache_salts_are_namespaced_so_no_client_can_take_a_tenants() -> None:
    plain = parse_request(chat(), endpoint=CHAT, bytes_per_token=4.0)
    assert with_cache_salt(plain, None) is plain and plain.cache_salt is None  # untouched
    tenant = with_cache_salt(parse_request(chat(), endpoint=CHAT, bytes_per_token=4.0), "T")
    assert tenant.cache_salt == "t:T" and orjson.loads(tenant.body)["cache_salt"] == "t:T"
    both = with_cache_salt(
        parse_request(chat(cache_salt="u1"), endpoint=CHAT, bytes_per_token=4.0), "T"
    )
    assert both.cache_salt == "t:T:u1"
    forged = with_cache_salt(
        parse_request(chat(cache_salt="t:T"), endpoint=CHAT, bytes_per_token=4.0), None
    )
    assert forged.cache_salt == "c:t:T"  # never equal to a tenant's salt
    for bad in ("", 7, "x" * (MAX_CLIENT_SALT + 1), "a@b", "a/b", "a\\b", "a\x00b"):
        with pytest.raises(EdgeError, match="cache_salt"):
            parse_request(chat(cache_salt=bad), endpoint=CHAT, bytes_per_token=4.0)


def test_the_longest_client_salt_joined_with_a_tenants_is_one_vllm_accepts() -> None:
    """vLLM 0.32 refuses a cache_salt over 128 characters or with '@ / \\' or NUL: what the
    edge lets through, joined with a tenant's salt (43 characters of URL-safe base64), never
    is."""
    longest = "k" * MAX_CLIENT_SALT
    req = parse_request(chat(cache_salt=longest), endpoint=CHAT, bytes_per_token=4.0)
    salted = with_cache_salt(req, "T" * 43)
    assert salted.cache_salt is not None and len(salted.cache_salt) <= 128


def test_an_event_that_never_ends_stops_the_framing_but_not_the_bytes() -> None:
    """An engine that sends over 1 MiB without a blank line: the tap stops holding it back
    (bounded memory) and passes everything through unchanged."""
    tap = UsageTap(strip=True)
    blob = b"data: " + b"x" * 600_000
    assert tap.feed(blob) == b""  # held: an event may still end
    out = tap.feed(blob)  # over 1 MiB pending: forwarded as is from now on
    assert out == blob + blob and tap.pending == b"" and not tap.framing
    assert tap.feed(USAGE) == USAGE  # no longer framed, so nothing is stripped either
