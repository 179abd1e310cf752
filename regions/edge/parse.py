"""Read only what routing needs from an OpenAI request body, and watch the response for usage.

The request is decoded once with orjson; the edge renders the prompt into bytes for the prefix
index (an approximation of the engine's chat template: the order and text of the messages is
what makes prefixes shared). The response is passed through byte for byte; :class:`UsageTap`
only frames it into SSE events to find the final usage chunk.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from typing import Any

import orjson

from regions.edge.errors import EdgeError

#: Body fields only the edge may set: vLLM's P/D and encoder-cache transfer handles (a client
#: value would point an engine at another request's KV blocks), engine plugin arguments,
#: scheduling priority (one tenant jumping every other tenant's queue) and the engine's request
#: id (a client-chosen id can collide with another tenant's request inside the engine).
EDGE_ONLY_FIELDS = (
    "kv_transfer_params",
    "ec_transfer_params",
    "vllm_xargs",
    "priority",
    "request_id",
)
#: Prompt tokens charged per image, audio or video part: the edge cannot see what the engine's
#: processor makes of it, so it charges a typical vision-encoder count and reconciles later.
MEDIA_PART_TOKENS = 1024
#: Output tokens a request without ``max_tokens`` is charged up front (reconciled at the end).
DEFAULT_OUTPUT_TOKENS = 1024
#: ``n``/``best_of`` above this are refused: each is another full generation to charge.
MAX_CHOICES = 128
CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
#: A client's ``cache_salt``: vLLM takes at most 1,024 characters, and a tenant's salt (a
#: base64 HMAC of 43) may be joined in front of it.
MAX_CLIENT_SALT = 960


@dataclass(slots=True)
class ParsedRequest:
    chat: bool
    model: str
    prompt: bytes
    #: Estimated prompt tokens (rendered bytes / bytes per token, or the exact id count), plus
    #: :data:`MEDIA_PART_TOKENS` per non-text part and the tool definitions' size.
    prompt_tokens: int
    stream: bool
    #: Upstream body: the client's bytes, or re-encoded when ``include_usage`` was added.
    body: bytes
    #: We asked the engine for a usage chunk the client did not want: strip it.
    strip_usage: bool
    user: str | None
    #: Output tokens the request may generate: choices x ``max_tokens`` (or the default).
    max_output_tokens: int = DEFAULT_OUTPUT_TOKENS
    #: vLLM's ``cache_salt`` as sent upstream (the client's, or the tenant's joined with it).
    cache_salt: str | None = None

    @property
    def path(self) -> str:
        """Where it goes upstream: the same endpoint it came in on."""
        return CHAT_PATH if self.chat else COMPLETIONS_PATH

    @property
    def cost_tokens(self) -> int:
        """The most this request can cost in tokens, charged to the tokens/s limit up front."""
        return self.prompt_tokens + self.max_output_tokens


def _bad(message: str, param: str | None, code: str = "invalid_request") -> EdgeError:
    return EdgeError(400, message, code, param)


def render_chat(messages: Any) -> tuple[bytes, int]:
    """(bytes to hash, number of non-text content parts: images, audio, video, files)."""
    if not isinstance(messages, list) or not messages:
        raise _bad("'messages' must be a non-empty array", "messages", "missing_messages")
    parts: list[str] = []
    media = 0
    for m in messages:
        if not isinstance(m, dict):
            raise _bad("each message must be an object", "messages")
        role = m.get("role")
        parts.append(role if isinstance(role, str) else "")
        parts.append("\n")
        content = m.get("content")
        if isinstance(content, str):
            parts.append(content)
        elif isinstance(content, list):
            for part in content:
                if isinstance(part, dict) and isinstance(part.get("text"), str):
                    parts.append(part["text"])
                else:
                    media += 1
        parts.append("\n\n")
    return "".join(parts).encode(), media


def _positive_int(doc: dict[str, Any], name: str, default: int | None) -> int | None:
    value = doc.get(name)
    if value is None:
        return default
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise _bad(f"'{name}' must be a positive integer", name)
    return value


def _output_tokens(doc: dict[str, Any]) -> int:
    """Choices x the per-choice output limit: what the tokens/s limit charges up front."""
    choices = max(_positive_int(doc, "n", 1) or 1, _positive_int(doc, "best_of", 1) or 1)
    if choices > MAX_CHOICES:
        raise _bad(f"'n' and 'best_of' may be at most {MAX_CHOICES}", "n")
    limit = _positive_int(doc, "max_completion_tokens", None)
    if limit is None:
        limit = _positive_int(doc, "max_tokens", DEFAULT_OUTPUT_TOKENS)
    return choices * (limit or DEFAULT_OUTPUT_TOKENS)


def render_completion(prompt: Any) -> tuple[bytes, int | None]:
    """(bytes to hash, exact token count when the prompt is already token ids)."""
    if isinstance(prompt, str):
        return prompt.encode(), None
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return "\n".join(prompt).encode(), None
        if all(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
            try:
                return array("I", prompt).tobytes(), len(prompt)
            except OverflowError:
                raise _bad("token ids must be non-negative 32-bit integers", "prompt") from None
    raise _bad(
        "'prompt' must be a string, an array of strings or of token ids", "prompt", "missing_prompt"
    )


def parse_request(raw: bytes, *, chat: bool, bytes_per_token: float) -> ParsedRequest:
    """Validate the fields the edge needs; leave the rest to the engine."""
    try:
        doc = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise _bad(f"request body is not valid JSON: {exc}", None, "invalid_json") from None
    if not isinstance(doc, dict):
        raise _bad("request body must be a JSON object", None, "invalid_json")
    model = doc.get("model")
    if not isinstance(model, str) or not model:
        raise _bad("'model' is required and must be a string", "model", "missing_model")
    for name in EDGE_ONLY_FIELDS:
        if name in doc:
            raise _bad(f"'{name}' is set by the edge only; remove it", name, "edge_only_field")
    exact: int | None = None
    media = 0
    if chat:
        prompt, media = render_chat(doc.get("messages"))
    else:
        prompt, exact = render_completion(doc.get("prompt"))
    tokens = exact if exact is not None else int(len(prompt) / bytes_per_token) + 1
    tokens += media * MEDIA_PART_TOKENS
    salt = doc.get("cache_salt")
    if salt is not None and not (isinstance(salt, str) and 0 < len(salt) <= MAX_CLIENT_SALT):
        raise _bad(
            f"'cache_salt' must be a non-empty string of at most {MAX_CLIENT_SALT} characters",
            "cache_salt",
        )
    tools = doc.get("tools")
    if tools:
        # Tool schemas are rendered into the prompt by the chat template.
        tokens += int(len(orjson.dumps(tools)) / bytes_per_token)
    stream = doc.get("stream") is True
    user = doc.get("user")
    body = raw
    strip = False
    if stream:
        opts = doc.get("stream_options")
        if not (isinstance(opts, dict) and opts.get("include_usage") is True):
            opts = dict(opts) if isinstance(opts, dict) else {}
            opts["include_usage"] = True
            doc["stream_options"] = opts
            body = orjson.dumps(doc)
            strip = True
    return ParsedRequest(
        chat=chat,
        model=model,
        prompt=prompt,
        prompt_tokens=tokens,
        stream=stream,
        body=body,
        strip_usage=strip,
        user=user if isinstance(user, str) and user else None,
        max_output_tokens=_output_tokens(doc),
        cache_salt=salt,
    )


def with_cache_salt(req: ParsedRequest, tenant_salt: str | None) -> ParsedRequest:
    """The request's ``cache_salt`` as the engine gets it. vLLM hashes the first KV block with
    the salt, so only requests with the same salt share cached prefixes. An isolated tenant's
    salt goes first (``t:<tenant>[:<client's>]``); a client's own salt is sent as
    ``c:<client's>``: no client, whatever it sends, can produce a tenant's salt."""
    if tenant_salt is None and req.cache_salt is None:
        return req
    if tenant_salt is not None:
        salt = f"t:{tenant_salt}" + (f":{req.cache_salt}" if req.cache_salt else "")
    else:
        salt = f"c:{req.cache_salt}"
    doc = orjson.loads(req.body)
    doc["cache_salt"] = salt
    req.body = orjson.dumps(doc)
    req.cache_salt = salt
    return req


def usage_numbers(usage: Any) -> tuple[int | None, int | None, int | None]:
    """(prompt_tokens, cached_tokens, completion_tokens) of an OpenAI ``usage`` object."""
    if not isinstance(usage, dict):
        return None, None, None
    prompt = usage.get("prompt_tokens")
    completion = usage.get("completion_tokens")
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return (
        prompt if isinstance(prompt, int) else None,
        cached if isinstance(cached, int) else None,
        completion if isinstance(completion, int) else None,
    )


def body_usage(body: bytes) -> tuple[int | None, int | None, int | None]:
    """Usage of a non-streamed response; parsed only when the body mentions it."""
    if b'"usage"' not in body:
        return None, None, None
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None, None, None
    return usage_numbers(doc.get("usage") if isinstance(doc, dict) else None)


#: An SSE stream's events end with a blank line; beyond this many bytes without one the tap
#: stops framing and forwards as is (still byte for byte).
_MAX_PENDING = 1 << 20


class UsageTap:
    """Frames an SSE stream into whole events, forwarding them unchanged.

    Records the usage chunk's numbers, drops that chunk when the edge added
    ``include_usage`` itself, and notes whether ``data: [DONE]`` arrived (a stream that ends
    without it was cut).
    """

    __slots__ = (
        "cached_tokens",
        "completion_tokens",
        "done",
        "events",
        "framing",
        "pending",
        "prompt_tokens",
        "strip",
    )

    def __init__(self, strip: bool) -> None:
        self.strip = strip
        self.pending = b""
        self.framing = True
        self.done = False
        self.prompt_tokens: int | None = None
        self.cached_tokens: int | None = None
        self.completion_tokens: int | None = None
        #: ``data:`` events forwarded: about one per generated token (what a cut stream
        #: relayed, when the engine's usage chunk never came).
        self.events = 0

    def feed(self, chunk: bytes) -> bytes:
        """Bytes to forward now (whole events only; a partial event waits for its end)."""
        if not self.framing:
            return chunk
        data = self.pending + chunk if self.pending else chunk
        cut = data.rfind(b"\n\n")
        if cut < 0:
            if len(data) > _MAX_PENDING:
                self.framing = False
                self.pending = b""
                return data
            self.pending = data
            return b""
        complete = data[: cut + 2]
        self.pending = data[cut + 2 :]
        self.events += complete.count(b"data: ")
        if b"[DONE]" in complete:
            self.done = True
        if b'"usage"' not in complete:
            return complete
        return self._usage_events(complete)

    def _usage_events(self, complete: bytes) -> bytes:
        out: list[bytes] = []
        for event in complete.split(b"\n\n")[:-1]:
            if b'"usage"' in event and event.startswith(b"data: {"):
                try:
                    doc = orjson.loads(event[6:])
                except orjson.JSONDecodeError:
                    doc = None
                if isinstance(doc, dict) and isinstance(doc.get("usage"), dict):
                    prompt, cached, completion = usage_numbers(doc["usage"])
                    if prompt is not None:
                        self.prompt_tokens = prompt
                    if cached is not None:
                        self.cached_tokens = cached
                    if completion is not None:
                        self.completion_tokens = completion
                    if self.strip and doc.get("choices") == []:
                        continue
            out.append(event)
            out.append(b"\n\n")
        return b"".join(out)
