"""The pure rules of mid-stream continuation (``regions/edge/policy/continuation.py``): what may
be continued, what the client received, the request for the rest, and the continued stream
made the rest of the client's."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from regions.edge.policy.continuation import (
    ContinuedTap,
    continuation_body,
    finish_event,
    not_continuable,
    read_relayed,
    text_mode_blocked,
    usage_event,
)

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}


def chunk(
    content: str | None, *, cid: str = "chatcmpl-1", created: int = 7, **choice: Any
) -> bytes:
    delta: dict[str, Any] = {} if content is None else {"content": content}
    delta.update(choice.pop("delta", {}))
    doc = {
        "id": cid,
        "object": "chat.completion.chunk",
        "created": created,
        "model": "m",
        "choices": [{"index": 0, "delta": delta, "finish_reason": None, **choice}],
    }
    return b"data: " + orjson.dumps(doc) + b"\n\n"


def role(cid: str = "chatcmpl-1", created: int = 7) -> bytes:
    return chunk("", cid=cid, created=created, delta={"role": "assistant"})


@pytest.mark.parametrize(
    ("kind", "extra", "why"),
    [
        ("chat", {}, None),
        ("chat", {"logprobs": True, "top_logprobs": 2}, None),
        ("chat", {"temperature": 0, "seed": 3}, None),
        ("chat", {"tools": [{"type": "function"}], "tool_choice": "auto"}, None),
        ("responses", {}, "endpoint"),
        ("chat", {"n": 2}, "several_choices"),
        ("completions", {"prompt": "x", "best_of": 3}, "several_choices"),
        ("completions", {"prompt": "x", "echo": True}, "echo"),
        ("chat", {"prompt_logprobs": 1}, "prompt_logprobs"),
        ("chat", {"response_format": {"type": "json_schema"}}, "structured_output"),
        ("chat", {"structured_outputs": {"regex": "a+"}}, "structured_output"),
        ("chat", {"seed": 3}, "seeded"),
        ("chat", {"stream_options": {"continuous_usage_stats": True}}, "continuous_usage"),
        ("chat", {"tool_choice": "required"}, "tool_call"),
        ("completions", {"prompt": [1, 2, 3]}, "token_prompt"),
        ("completions", {"prompt": [1, 2, 3], "return_token_ids": True}, None),
        ("completions", {"prompt": ["one prompt"]}, None),
    ],
)
def test_what_may_be_continued(kind: str, extra: dict[str, Any], why: str | None) -> None:
    assert not_continuable(kind, {**CHAT, **extra}) == why


def test_what_the_client_received_is_read_from_the_events() -> None:
    relayed = read_relayed([role() + chunk("Once"), chunk(" upon") + chunk(" a")], chat=True)
    assert relayed.text == "Once upon a"
    assert relayed.tokens == 3
    assert (relayed.id, relayed.created) == (b"chatcmpl-1", b"7")
    assert relayed.finish_reason is None and relayed.blocked is None
    assert relayed.token_ids is None


def test_token_ids_count_when_every_event_carries_them() -> None:
    events = [
        role() + chunk("Once", token_ids=[11]),
        chunk("", token_ids=[12]),  # a partial character: an id, no text yet
        chunk(" upon", token_ids=[13, 14]),
    ]
    relayed = read_relayed(events, chat=True)
    assert relayed.token_ids == [11, 12, 13, 14] and relayed.tokens == 4


@pytest.mark.parametrize(
    ("delta", "why"),
    [({"tool_calls": [{"index": 0}]}, "tool_call"), ({"reasoning_content": "hm"}, "reasoning")],
)
def test_a_tool_call_or_reasoning_under_way_blocks_it(delta: dict[str, Any], why: str) -> None:
    relayed = read_relayed([role() + chunk(None, delta=delta)], chat=True)
    assert relayed.blocked == why
    assert text_mode_blocked("chat", orjson.dumps(CHAT), relayed) == why


def test_a_finish_already_relayed_is_seen() -> None:
    relayed = read_relayed([role() + chunk("Hi") + chunk("", finish_reason="stop")], chat=True)
    assert relayed.finish_reason == "stop"


def test_the_chat_continuation_leaves_the_answer_open_and_shrinks_the_limits() -> None:
    body = orjson.dumps({**CHAT, "max_tokens": 10, "min_tokens": 4, "cache_salt": "t:x"})
    relayed = read_relayed([role() + chunk("Once") + chunk(" upon")], chat=True)
    doc = orjson.loads(continuation_body("chat", body, relayed) or b"")
    assert doc["messages"][-1] == {"role": "assistant", "content": "Once upon"}
    assert doc["continue_final_message"] is True and doc["add_generation_prompt"] is False
    assert (doc["max_tokens"], doc["min_tokens"]) == (8, 2)
    assert doc["cache_salt"] == "t:x"  # the tenant's cache isolation goes with it


def test_a_client_side_continuation_goes_on_in_its_own_message() -> None:
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Say"}]
    body = orjson.dumps({**CHAT, "messages": msgs, "continue_final_message": True})
    relayed = read_relayed([role() + chunk(" yes")], chat=True)
    doc = orjson.loads(continuation_body("chat", body, relayed) or b"")
    assert doc["messages"] == [msgs[0], {"role": "assistant", "content": "Say yes"}]


def test_nothing_is_left_when_the_limit_was_reached() -> None:
    body = orjson.dumps({**CHAT, "max_completion_tokens": 2})
    relayed = read_relayed([role() + chunk("a") + chunk("b")], chat=True)
    assert continuation_body("chat", body, relayed) is None


def test_completions_continue_as_text_or_exactly_as_ids() -> None:
    text = orjson.dumps({"model": "m", "prompt": "Once", "stream": True})
    comp = b'data: {"id":"cmpl-1","created":7,"choices":[{"index":0,"text":" upon"}]}\n\n'
    relayed = read_relayed([comp], chat=False)
    doc = orjson.loads(continuation_body("completions", text, relayed) or b"")
    assert doc["prompt"] == "Once upon" and doc["max_tokens"] == 15  # vLLM's default 16, less 1

    ids = orjson.dumps({"model": "m", "prompt": [1, 2], "stream": True, "return_token_ids": True})
    first = (
        b'data: {"id":"cmpl-1","created":7,"choices":[{"index":0,"text":" up",'
        b'"prompt_token_ids":[1,2],"token_ids":[5]}]}\n\n'
    )
    relayed = read_relayed([first], chat=False)
    assert text_mode_blocked("completions", ids, relayed) is None
    assert orjson.loads(continuation_body("completions", ids, relayed) or b"")["prompt"] == [
        1,
        2,
        5,
    ]


def test_the_continued_stream_becomes_the_rest_of_the_clients() -> None:
    relayed = read_relayed([role() + chunk("Once") + chunk(" upon")], chat=True)
    tap = ContinuedTap(False, True, relayed)
    out = tap.feed(role("chatcmpl-2", 9) + chunk(" a", cid="chatcmpl-2", created=9))
    out += tap.feed(chunk(" time", cid="chatcmpl-2", created=9, finish_reason="stop"))
    assert tap.relayed_tokens == 2  # what a cut here would count: the opening is not a token
    usage = {"prompt_tokens": 30, "completion_tokens": 3, "total_tokens": 33}
    end = {"id": "chatcmpl-2", "created": 9, "choices": [], "usage": usage}
    out += tap.feed(b"data: " + orjson.dumps(end) + b"\n\ndata: [DONE]\n\n")
    events = [orjson.loads(e[6:]) for e in out.split(b"\n\n") if e.startswith(b"data: {")]
    assert b'"role"' not in out  # the client had the opening
    assert {e["id"] for e in events} == {"chatcmpl-1"} and {e["created"] for e in events} == {7}
    # The prompt once (30 processed, 2 of them the answer so far), every token received.
    assert events[-1]["usage"] == {"prompt_tokens": 28, "completion_tokens": 5, "total_tokens": 33}
    assert tap.client_usage() == (28, 0, 5) and tap.reprefill_tokens == 30
    assert tap.done


def test_the_usage_the_edge_added_is_stripped_from_a_continuation_too() -> None:
    relayed = read_relayed([role() + chunk("a")], chat=True)
    tap = ContinuedTap(True, True, relayed)
    usage = {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}
    out = tap.feed(chunk("b") + b"data: " + orjson.dumps({"choices": [], "usage": usage}) + b"\n\n")
    assert b"usage" not in out and tap.client_usage() == (4, 0, 2)


def test_an_answer_ended_by_the_edge_has_its_finish_and_usage() -> None:
    relayed = read_relayed([role() + chunk("a") + chunk("b")], chat=True)
    finish = orjson.loads(finish_event("chat", relayed, "m", "length")[6:])
    assert finish["id"] == "chatcmpl-1" and finish["choices"][0]["finish_reason"] == "length"
    usage = orjson.loads(usage_event(relayed, "m", 9)[6:])["usage"]
    assert usage == {"prompt_tokens": 9, "completion_tokens": 2, "total_tokens": 11}
