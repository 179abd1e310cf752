"""The edge's routes beyond chat and completions: what it reads of their bodies and answers."""

from __future__ import annotations

import orjson
import pytest

from regions.edge.http.endpoints import CHAT, EMBEDDINGS, ENDPOINTS, RESPONSES, TOKENIZE
from regions.edge.http.errors import EdgeError
from regions.edge.http.parse import (
    DEFAULT_OUTPUT_TOKENS,
    MAX_BATCH_INPUTS,
    ResponsesTap,
    body_usage,
    parse_request,
)
from regions.edge.policy.scheduler import Candidate, decide_unqueued


def parse(path: str, **doc: object) -> object:
    raw = orjson.dumps({"model": "m", **doc})
    return parse_request(raw, endpoint=ENDPOINTS[path], bytes_per_token=4.0)


def test_routes_are_vllms() -> None:
    assert set(ENDPOINTS) == {
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/responses",
        "/v1/embeddings",
        "/v2/embed",
        "/pooling",
        "/classify",
        "/score",
        "/v1/score",
        "/rerank",
        "/v1/rerank",
        "/v2/rerank",
        "/tokenize",
        "/detokenize",
    }
    assert [e.generates for e in (CHAT, RESPONSES, EMBEDDINGS, TOKENIZE)] == [
        True,
        True,
        False,
        False,
    ]
    assert [e.queued for e in (CHAT, EMBEDDINGS, TOKENIZE)] == [True, True, False]


def test_pooling_costs_its_prompt_only_and_pairs_count() -> None:
    one = parse_request(
        orjson.dumps({"model": "m", "input": "x" * 400}), endpoint=EMBEDDINGS, bytes_per_token=4.0
    )
    assert (one.prompt_tokens, one.max_output_tokens, one.cost_tokens) == (101, 0, 101)
    assert one.prompt == b"" and not one.stream  # nothing to hash, never streamed
    batch = parse("/v1/embeddings", input=["x" * 40, [1, 2, 3]])
    assert batch.prompt_tokens == 11 + 3  # type: ignore[attr-defined]
    # One query paired with each of three documents: the query counts three times.
    rerank = parse("/rerank", query="q" * 40, documents=["d" * 8] * 3)
    assert rerank.prompt_tokens == 11 * 3 + 3 * 3  # type: ignore[attr-defined]
    chat = parse("/v1/chat/completions", messages=[{"role": "user", "content": "x"}])
    assert chat.max_output_tokens == DEFAULT_OUTPUT_TOKENS  # type: ignore[attr-defined]
    for path, field in (("/v1/embeddings", "input"), ("/v2/rerank", "documents")):
        with pytest.raises(EdgeError) as err:
            parse(path, query="q", **{field: ["a"] * (MAX_BATCH_INPUTS + 1)})
        assert (err.value.status, err.value.param) == (400, field)


def test_responses_requests() -> None:
    req = parse(
        "/v1/responses",
        instructions="be brief",
        input=[{"role": "user", "content": [{"type": "input_text", "text": "hello"}]}],
        max_output_tokens=7,
        stream=True,
    )
    assert req.prompt == b"system\nbe brief\n\nuser\nhello\n\n"  # type: ignore[attr-defined]
    assert req.max_output_tokens == 7 and req.stream  # type: ignore[attr-defined]
    assert not req.strip_usage and b"stream_options" not in req.body  # type: ignore[attr-defined]
    for field, value in (("previous_response_id", "resp_1"), ("background", True)):
        with pytest.raises(EdgeError) as err:
            parse("/v1/responses", input="hi", **{field: value})
        assert err.value.code == "unsupported_field"
    with pytest.raises(EdgeError):
        parse("/v1/responses", input=[])


def test_tokenizer_requests() -> None:
    assert parse("/tokenize", prompt="x" * 8).prompt_tokens == 3  # type: ignore[attr-defined]
    assert parse("/detokenize", tokens=[1, 2]).cost_tokens == 2  # type: ignore[attr-defined]
    for bad in ([1, "2"], "12", [True]):
        with pytest.raises(EdgeError) as err:
            parse("/detokenize", tokens=bad)
        assert err.value.param == "tokens"
    with pytest.raises(EdgeError):
        parse("/tokenize", prompt=3)


def test_usage_of_every_shape() -> None:
    responses = {
        "usage": {
            "input_tokens": 10,
            "input_tokens_details": {"cached_tokens": 4},
            "output_tokens": 5,
            "total_tokens": 15,
        }
    }
    assert body_usage(orjson.dumps(responses)) == (10, 4, 5)
    embed = {"usage": {"prompt_tokens": 9, "total_tokens": 9, "completion_tokens": 0}}
    assert body_usage(orjson.dumps(embed)) == (9, None, 0)
    assert body_usage(orjson.dumps({"usage": {"total_tokens": 12}})) == (12, None, 0)
    cohere = {"meta": {"billed_units": {"input_tokens": 6, "image_tokens": None}}}
    assert body_usage(orjson.dumps(cohere)) == (6, None, 0)
    assert body_usage(b'{"count": 3, "tokens": [1, 2, 3]}') == (None, None, None)


def _events(*docs: dict[str, object]) -> bytes:
    return b"".join(
        b"event: " + str(d["type"]).encode() + b"\ndata: " + orjson.dumps(d) + b"\n\n" for d in docs
    )


def test_responses_tap_reads_usage_from_the_end_and_counts_text_deltas() -> None:
    opening = _events(
        {"type": "response.created", "response": {"usage": None}},
        {"type": "response.in_progress", "response": {"usage": None}},
    )
    deltas = _events(*({"type": "response.output_text.delta", "delta": "a"} for _ in range(3)))
    usage = {"input_tokens": 8, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": 3}
    end = _events({"type": "response.completed", "response": {"usage": usage}})
    tap = ResponsesTap()
    out = tap.feed(opening + deltas[:5])
    assert out == opening and not tap.done and tap.first_token_at is None
    out += tap.feed(deltas[5:]) + tap.feed(end)
    assert out == opening + deltas + end  # relayed unchanged
    assert tap.done and tap.relayed_tokens == 3 and tap.first_token_at is not None
    assert (tap.prompt_tokens, tap.cached_tokens, tap.completion_tokens) == (8, 0, 3)
    cut = ResponsesTap()
    cut.feed(opening + deltas)
    assert not cut.done and cut.relayed_tokens == 3 and cut.prompt_tokens is None


def _cand(name: str, outstanding: int, **kw: object) -> Candidate:
    fields: dict[str, object] = {
        "id": name,
        "model": "m",
        "adapters": (),
        "role": "mixed",
        "state": "ready",
        "healthy": True,
        "max_concurrency": 4,
        "prefill_tokens_per_s": 1000.0,
        "inflight": outstanding,
        "outstanding": outstanding,
        "waiting": 0,
        "kv_usage": 0.0,
        "pending_tokens": 0.0,
        "mean_uncached_tokens": 0.0,
        "mean_service_s": 1.0,
    }
    fields.update(kw)
    return Candidate(**fields)  # type: ignore[arg-type]


def test_unqueued_calls_take_the_least_loaded_instance_even_at_its_cap() -> None:
    full = [_cand("a", 4), _cand("b", 9, role="prefill"), _cand("c", 5, healthy=False)]
    d = decide_unqueued(full, "m", frozenset())
    assert (d.reason, d.winner and d.winner.instance) == ("unqueued", "a")
    assert d.runner_up is not None and d.runner_up.instance == "b"
    assert decide_unqueued(full, "m", frozenset({"a", "b"})).reason == "no_healthy_instance"
    assert decide_unqueued(full, "other", frozenset()).reason == "unknown_model"
