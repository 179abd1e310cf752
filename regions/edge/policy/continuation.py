"""Continuing a stream whose engine failed after its first token: what may be continued, what
the client has already received, and the request that asks another engine for the rest.

Pure: no I/O (the stage is ``stages/continuation.py``). The edge keeps the events it relayed
(as the bytes it sent, parsed only when a continuation is needed, so relaying stays a list
append per chunk). To continue, it re-sends the request with the answer so far as the start of
the answer:

* chat: the text as a final assistant message, with vLLM's ``continue_final_message: true``
  and ``add_generation_prompt: false`` (the chat template leaves that message open);
* completions: the prompt followed by the text — or, exactly, the prompt's token ids followed
  by the answer's when the client asked for ``return_token_ids`` (the engine then sees the very
  tokens the first one produced; text is re-tokenized, which can split a word differently, and
  a chat template strips the open message's trailing whitespace).

The token limits shrink by the tokens already relayed. What cannot be continued faithfully
ends as before, with the reason (:func:`not_continuable`, :attr:`Relayed.blocked`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import orjson

from regions.edge.http.parse import UsageTap

#: vLLM's default ``max_tokens`` of a completions request (chat has none: up to the context).
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
#: Request fields whose output a second engine cannot take up where the first left off.
_STRUCTURED = (
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "structured_outputs",
)
_ID = re.compile(rb'"id":"([^"\\]{1,256})"')
_CREATED = re.compile(rb'"created":(\d{1,20})')


def not_continuable(kind: str, doc: dict[str, Any] | None) -> str | None:
    """Why a streamed request of endpoint ``kind`` cannot be continued on another engine, or
    None when it can. Decided at admission, from the request alone."""
    if kind not in ("chat", "completions"):
        return "endpoint"  # a Responses stream's events carry the engine's own state
    if doc is None:
        return "endpoint"
    if doc.get("n", 1) not in (None, 1) or doc.get("best_of") not in (None, 1):
        return "several_choices"
    if doc.get("echo"):
        return "echo"
    if doc.get("prompt_logprobs") is not None:
        return "prompt_logprobs"
    return _sampling_not_continuable(kind, doc)


def _sampling_not_continuable(kind: str, doc: dict[str, Any]) -> str | None:
    response_format = doc.get("response_format")
    if isinstance(response_format, dict) and response_format.get("type") not in (None, "text"):
        return "structured_output"  # the grammar would restart inside the answer
    if any(doc.get(name) is not None for name in _STRUCTURED):
        return "structured_output"
    if doc.get("seed") is not None and doc.get("temperature") != 0:
        return "seeded"  # a seeded answer is one the client can reproduce: another is not it
    options = doc.get("stream_options")
    if isinstance(options, dict) and options.get("continuous_usage_stats"):
        return "continuous_usage"
    tool_choice = doc.get("tool_choice")
    if tool_choice not in (None, "auto", "none"):
        return "tool_call"  # the answer is a forced tool call from its first token
    if kind == "completions":
        prompt = doc.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if not isinstance(prompt, str) and not doc.get("return_token_ids"):
            return "token_prompt"  # ids, but the answer's ids will not be known
    return None


@dataclass(slots=True)
class Relayed:
    """What the client received of a stream, read from the events relayed."""

    #: The stream's ``id`` and ``created`` (its first event's): continued events take them.
    id: bytes | None = None
    created: bytes | None = None
    text_parts: list[str] = field(default_factory=list)
    #: Events that carried output (about one token each: vLLM sends one per token).
    token_events: int = 0
    #: The answer's token ids and the prompt's, when the client asked ``return_token_ids``.
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None
    #: The answer already ended (its finish reason was relayed, only the end was lost).
    finish_reason: str | None = None
    #: Why what was relayed cannot be continued (a tool call or reasoning under way).
    blocked: str | None = None

    @property
    def text(self) -> str:
        return "".join(self.text_parts)

    @property
    def tokens(self) -> int:
        """Output tokens relayed: the ids' count when every event carried them, else events."""
        if self.token_ids is not None:
            return len(self.token_ids)
        return self.token_events


def read_relayed(chunks: list[bytes], chat: bool) -> Relayed:
    """Parse the events relayed so far (the bytes as sent, whole events only)."""
    out = Relayed()
    ids: list[int] | None = []
    for chunk in chunks:
        for event in chunk.split(b"\n\n"):
            if event.startswith(b"data: {"):
                ids = _read_event(out, event, chat, ids)
                if out.blocked:
                    return out
    out.token_ids = ids if ids and len(ids) >= out.token_events else None
    return out


def _read_event(out: Relayed, event: bytes, chat: bool, ids: list[int] | None) -> list[int] | None:
    try:
        doc = orjson.loads(event[6:])
    except orjson.JSONDecodeError:
        out.blocked = "unreadable"
        return ids
    if not isinstance(doc, dict):
        return ids
    if out.id is None:
        m = _ID.search(event)
        out.id = m.group(1) if m else None
        c = _CREATED.search(event)
        out.created = c.group(1) if c else None
    prompt_ids = doc.get("prompt_token_ids")
    for choice in doc.get("choices") or ():
        if not isinstance(choice, dict):
            continue
        if choice.get("index", 0) != 0:
            out.blocked = "several_choices"
            return ids
        if prompt_ids is None:
            prompt_ids = choice.get("prompt_token_ids")
        ids = _read_choice(out, choice, chat, ids)
    if isinstance(prompt_ids, list) and out.prompt_token_ids is None:
        out.prompt_token_ids = prompt_ids
    return ids


def _read_choice(
    out: Relayed, choice: dict[str, Any], chat: bool, ids: list[int] | None
) -> list[int] | None:
    if chat:
        delta = choice.get("delta")
        delta = delta if isinstance(delta, dict) else {}
        if delta.get("tool_calls"):
            out.blocked = "tool_call"
        elif delta.get("reasoning_content") or delta.get("reasoning"):
            out.blocked = "reasoning"
        content = delta.get("content")
    else:
        content = choice.get("text")
    if isinstance(content, str) and content:
        out.text_parts.append(content)
        out.token_events += 1
    token_ids = choice.get("token_ids")
    if ids is not None:
        if isinstance(token_ids, list):
            ids.extend(t for t in token_ids if isinstance(t, int))
        elif content:
            ids = None  # an event without ids: count events instead
    finish = choice.get("finish_reason")
    if isinstance(finish, str):
        out.finish_reason = finish
    return ids


def continuation_body(kind: str, body: bytes, relayed: Relayed) -> bytes | None:
    """The request for the rest of the answer (None: nothing is left to generate — the token
    limit was reached), from the body first sent upstream."""
    doc = orjson.loads(body)
    done = relayed.tokens
    limits = ("max_tokens", "max_completion_tokens")
    if kind == "completions" and not any(name in doc for name in limits):
        doc["max_tokens"] = COMPLETIONS_DEFAULT_MAX_TOKENS
    for name in limits:
        value = doc.get(name)
        if isinstance(value, int) and not isinstance(value, bool):
            if value - done <= 0:
                return None
            doc[name] = value - done
    min_tokens = doc.get("min_tokens")
    if isinstance(min_tokens, int) and min_tokens:
        doc["min_tokens"] = max(0, min_tokens - done)
    if kind == "chat":
        _continue_chat(doc, relayed.text)
    else:
        _continue_completion(doc, relayed)
    return orjson.dumps(doc)


def _continue_chat(doc: dict[str, Any], text: str) -> None:
    messages = list(doc["messages"])
    last = messages[-1] if messages else None
    if (
        doc.get("continue_final_message")
        and isinstance(last, dict)
        and last.get("role") == "assistant"
        and isinstance(last.get("content"), str)
    ):
        # The client was continuing an answer itself: this one goes on from there.
        messages[-1] = {**last, "content": last["content"] + text}
    else:
        messages.append({"role": "assistant", "content": text})
    doc["messages"] = messages
    doc["continue_final_message"] = True
    doc["add_generation_prompt"] = False


def _continue_completion(doc: dict[str, Any], relayed: Relayed) -> None:
    if relayed.prompt_token_ids is not None and relayed.token_ids is not None:
        doc["prompt"] = relayed.prompt_token_ids + relayed.token_ids
        return
    prompt = doc["prompt"]
    if isinstance(prompt, list):
        doc["prompt"] = [prompt[0] + relayed.text]
    else:
        doc["prompt"] = prompt + relayed.text


def text_mode_blocked(kind: str, body: bytes, relayed: Relayed) -> str | None:
    """Why this answer cannot be continued although its request could (a completion whose
    prompt is token ids, without the answer's ids to append)."""
    if relayed.blocked:
        return relayed.blocked
    if kind != "completions" or (
        relayed.token_ids is not None and relayed.prompt_token_ids is not None
    ):
        return None
    prompt = orjson.loads(body).get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    return None if isinstance(prompt, str) else "token_prompt"


class ContinuedTap(UsageTap):
    """The stream of a continuation, made the rest of the client's stream: its events take
    the first stream's ``id`` and ``created``, its opening role event (chat) and repeated
    prompt ids are dropped, and its usage counts the prompt once and every token the client
    received (the re-prefill is reported apart, as :attr:`reprefill_tokens`)."""

    __slots__ = ("_created", "_id", "_new_created", "_new_id", "_opened", "before", "chat")

    def __init__(self, strip: bool, chat: bool, relayed: Relayed) -> None:
        super().__init__(strip)
        self.chat = chat
        #: Output tokens the client had before this leg.
        self.before = relayed.tokens
        self._id, self._created = relayed.id, relayed.created
        self._new_id: bytes | None = None
        self._new_created: bytes | None = None
        self._opened = not chat

    @property
    def relayed_tokens(self) -> int:
        """Tokens the client got in this leg."""
        return max(self.events - (1 if self.chat else 0), 0)

    @property
    def reprefill_tokens(self) -> int | None:
        """The prompt this leg's engine processed (the prompt and the answer so far)."""
        return self.prompt_tokens

    def client_usage(self) -> tuple[int, int, int] | None:
        """(prompt, cached, completion) as the client is billed, from this leg's report."""
        if self.prompt_tokens is None or self.completion_tokens is None:
            return None
        prompt = max(self.prompt_tokens - self.before, 0)
        cached = min(self.cached_tokens or 0, prompt)
        return prompt, cached, self.before + self.completion_tokens

    def feed(self, chunk: bytes) -> bytes:
        out = super().feed(chunk)
        return self._rewrite(out) if out else out

    def _rewrite(self, out: bytes) -> bytes:
        if self._new_id is None:
            m = _ID.search(out)
            c = _CREATED.search(out)
            self._new_id = m.group(1) if m else b""
            self._new_created = c.group(1) if c else None
        if not self._opened:
            self._opened = True
            out = _drop_opening(out)
        if self._new_id and self._id and self._new_id != self._id:
            out = out.replace(b'"id":"' + self._new_id + b'"', b'"id":"' + self._id + b'"')
        if self._new_created and self._created and self._new_created != self._created:
            out = out.replace(
                b'"created":' + self._new_created + b",", b'"created":' + self._created + b","
            )
        if b'"prompt_token_ids":[' in out:
            out = _without_prompt_ids(out)
        return out

    def _usage_event(self, event: bytes, doc: dict[str, Any]) -> bytes:
        usage = self.client_usage()
        if usage is None:
            return event
        return b"data: " + orjson.dumps({**doc, "usage": _usage_doc(*usage)})


def _usage_doc(prompt: int, cached: int, completion: int) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens": completion,
    }
    if cached:
        doc["prompt_tokens_details"] = {"cached_tokens": cached}
    return doc


def _drop_opening(out: bytes) -> bytes:
    """Without a chat stream's opening event (the role, no text): the client had it."""
    first, _, rest = out.partition(b"\n\n")
    if not first.startswith(b"data: {") or b'"role"' not in first:
        return out
    try:
        doc = orjson.loads(first[6:])
    except orjson.JSONDecodeError:
        return out
    choices = doc.get("choices") if isinstance(doc, dict) else None
    delta = choices[0].get("delta") if choices and isinstance(choices[0], dict) else None
    if isinstance(delta, dict) and not delta.get("content") and not delta.get("tool_calls"):
        return rest
    return out


def _without_prompt_ids(out: bytes) -> bytes:
    """Events without the prompt's ids, which the client had in the first event."""
    events = []
    for event in out.split(b"\n\n"):
        if b'"prompt_token_ids":[' in event and event.startswith(b"data: {"):
            doc = orjson.loads(event[6:])
            if isinstance(doc, dict):
                if "prompt_token_ids" in doc:
                    doc["prompt_token_ids"] = None
                for choice in doc.get("choices") or ():
                    if isinstance(choice, dict) and "prompt_token_ids" in choice:
                        choice["prompt_token_ids"] = None
                event = b"data: " + orjson.dumps(doc)
        events.append(event)
    return b"\n\n".join(events)


def _chunk_head(kind: str, relayed: Relayed, model: str) -> dict[str, Any]:
    return {
        "id": (relayed.id or b"").decode(),
        "object": "chat.completion.chunk" if kind == "chat" else "text_completion",
        "created": int(relayed.created or 0),
        "model": model,
    }


def finish_event(kind: str, relayed: Relayed, model: str, reason: str) -> bytes:
    """The event that ends an answer with ``reason`` (every token asked for was relayed)."""
    choice: dict[str, Any] = {"index": 0, "finish_reason": reason}
    if kind == "chat":
        choice["delta"] = {}
    else:
        choice["text"] = ""
    doc = {**_chunk_head(kind, relayed, model), "choices": [choice]}
    return b"data: " + orjson.dumps(doc) + b"\n\n"


def usage_event(relayed: Relayed, model: str, prompt_tokens: int, kind: str = "chat") -> bytes:
    """The usage event of an answer the edge ended itself: the prompt as the edge counted it,
    the completion as relayed."""
    doc = {
        **_chunk_head(kind, relayed, model),
        "choices": [],
        "usage": _usage_doc(prompt_tokens, 0, relayed.tokens),
    }
    return b"data: " + orjson.dumps(doc) + b"\n\n"
