"""vLLM's Responses API (``/v1/responses``) on the simulator: the request's ``instructions`` and
``input`` as chat messages, and the answer in vLLM 0.32's shapes
(``vllm/entrypoints/openai/responses/``): a ``response`` object, or a stream of
``event: <type>`` / ``data: {...}`` events — ``response.created`` and ``response.in_progress``
at once, ``response.output_item.added`` and ``response.content_part.added`` with the first
text, one ``response.output_text.delta`` per token, then the ``.done`` events and
``response.completed`` carrying the usage (no ``[DONE]``: the API has no ``include_usage``).
"""

from __future__ import annotations

import random
import time
from typing import Any

import orjson

from regions.engines.simulator.scheduler import Request, Status

_ids = random.Random()


def responses_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """``instructions`` (a system message) and ``input`` (a string: one user message; or a
    list of message items whose ``input_text``/``output_text`` parts are text) as chat
    messages. :class:`ValueError` for an input the simulator does not model (tools, media)."""
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if isinstance(instructions, str):
        messages.append({"role": "system", "content": instructions})
    value = body.get("input")
    if isinstance(value, str):
        messages.append({"role": "user", "content": value})
        return messages
    if not isinstance(value, list) or not value:
        raise ValueError("'input' must be a string or a non-empty list of messages")
    for item in value:
        if not isinstance(item, dict) or not isinstance(item.get("role"), str):
            raise ValueError("the simulator models message items of 'input' only")
        content = item.get("content")
        if isinstance(content, list):
            texts = []
            for part in content:
                if not isinstance(part, dict) or not isinstance(part.get("text"), str):
                    raise ValueError("the simulator models text parts of 'input' only")
                texts.append({"type": "text", "text": part["text"]})
            content = texts
        messages.append({"role": item["role"], "content": content})
    return messages


def _event(kind: str, seq: int, fields: dict[str, Any]) -> str:
    # vLLM's event models list their fields in alphabetical order.
    data = orjson.dumps(dict(sorted({**fields, "sequence_number": seq, "type": kind}.items())))
    return f"event: {kind}\ndata: {data.decode()}\n\n"


class ResponsesFormatter:
    """The answer of one Responses request, as
    :class:`~.openai_protocol.CompletionFormatter` formats chat: same methods, so
    ``GenerationApi._generate`` streams or sends it the same way."""

    #: Stream events go out from the start (``response.created`` before any token).
    eager = True
    #: No terminal ``[DONE]``: ``response.completed`` ends the stream.
    done = b""
    chat = False
    include_usage = False

    def __init__(self, model: str, body: dict[str, Any], num_prompt: int) -> None:
        self.model = model
        self.body = body
        self.num_prompt = num_prompt
        self.rid = f"resp_{_ids.getrandbits(128):032x}"
        self.item_id = f"msg_{_ids.getrandbits(128):032x}"
        self.created_at = int(time.time())
        self.seq = 0

    def _next(self, kind: str, fields: dict[str, Any]) -> str:
        event = _event(kind, self.seq, fields)
        self.seq += 1
        return event

    def response(
        self, status: str, output: list[Any], usage: dict[str, Any] | None
    ) -> dict[str, Any]:
        """The ``response`` object (``ResponsesResponse`` dumped with every field)."""
        body = self.body
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {
            "id": self.rid,
            "created_at": self.created_at,
            "incomplete_details": incomplete,
            "instructions": body.get("instructions"),
            "metadata": body.get("metadata"),
            "model": self.model,
            "object": "response",
            "output": output,
            "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "temperature": body.get("temperature", 1.0),
            "tool_choice": body.get("tool_choice", "auto" if body.get("tools") else "none"),
            "tools": body.get("tools", []),
            "top_p": body.get("top_p", 1.0),
            "background": False,
            "max_output_tokens": body.get("max_output_tokens"),
            "max_tool_calls": body.get("max_tool_calls"),
            "previous_response_id": None,
            "prompt": None,
            "reasoning": None,
            "service_tier": body.get("service_tier", "auto"),
            "status": status,
            "text": None,
            "top_logprobs": body.get("top_logprobs"),
            "truncation": body.get("truncation", "disabled"),
            "usage": usage,
            "user": body.get("user"),
            "presence_penalty": body.get("presence_penalty", 0.0),
            "frequency_penalty": body.get("frequency_penalty", 0.0),
            "kv_transfer_params": None,
            "ec_transfer_params": None,
            "input_messages": None,
            "output_messages": None,
        }

    def _usage(self, request: Request) -> dict[str, Any]:
        out = len(request.output_token_ids)
        return {
            "input_tokens": self.num_prompt,
            "input_tokens_details": {
                "cached_tokens": max(request.num_cached_tokens, 0),
                "cache_write_tokens": 0,
                "input_tokens_per_turn": [],
                "cached_tokens_per_turn": [],
            },
            "output_tokens": out,
            "output_tokens_details": {
                "reasoning_tokens": 0,
                "tool_output_tokens": 0,
                "output_tokens_per_turn": [],
                "tool_output_tokens_per_turn": [],
            },
            "total_tokens": self.num_prompt + out,
        }

    def _message(self, text: str, status: str) -> dict[str, Any]:
        content = [] if status == "in_progress" else [self._text_part(text)]
        return {
            "id": self.item_id,
            "content": content,
            "role": "assistant",
            "status": status,
            "type": "message",
            "phase": None,
        }

    @staticmethod
    def _text_part(text: str, logprobs: list[Any] | None = None) -> dict[str, Any]:
        return {"annotations": [], "text": text, "type": "output_text", "logprobs": logprobs}

    def opening(self) -> bytes:
        state = self.response("in_progress", [], None)
        return (
            self._next("response.created", {"response": state})
            + self._next("response.in_progress", {"response": state})
        ).encode()

    def token_chunks(self, texts: list[str], start: int, end: int, request: Request) -> bytes:
        out = []
        place = {"output_index": 0, "item_id": self.item_id, "content_index": 0}
        if start == 0 and end > 0:
            out.append(
                self._next(
                    "response.output_item.added",
                    {"output_index": 0, "item": self._message("", "in_progress")},
                )
            )
            out.append(
                self._next(
                    "response.content_part.added", {**place, "part": self._text_part("", [])}
                )
            )
        for i in range(start, end):
            out.append(
                self._next(
                    "response.output_text.delta", {**place, "delta": texts[i], "logprobs": []}
                )
            )
        if request.status is Status.FINISHED and end == len(texts):
            out.append(self._closing(texts, request))
        return "".join(out).encode()

    def _closing(self, texts: list[str], request: Request) -> str:
        text = "".join(texts)
        place = {"output_index": 0, "item_id": self.item_id, "content_index": 0}
        item = self._message(text, "completed")
        return (
            self._next("response.output_text.done", {**place, "text": text, "logprobs": []})
            + self._next("response.content_part.done", {**place, "part": self._text_part(text)})
            + self._next("response.output_item.done", {"output_index": 0, "item": item})
            + self._next(
                "response.completed",
                {"response": self.response(_status(request), [item], self._usage(request))},
            )
        )

    def usage_chunk(self, request: Request) -> bytes:
        return b""

    def full_response(
        self, request: Request, texts: list[str], kv_params: dict[str, Any] | None = None
    ) -> bytes:
        item = self._message("".join(texts), "completed")
        doc = self.response(_status(request), [item], self._usage(request))
        doc["kv_transfer_params"] = kv_params
        return orjson.dumps(doc)


def _status(request: Request) -> str:
    """``incomplete`` when the answer stopped at ``max_output_tokens``."""
    return "incomplete" if request.finish_reason == "length" else "completed"
