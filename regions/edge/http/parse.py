"""Read only what routing needs from an OpenAI request body, and watch the response for usage.

The request is decoded once with orjson; the edge renders the prompt into bytes for the prefix
index (an approximation of the engine's chat template: the order and text of the messages is
what makes prefixes shared). The response is passed through byte for byte; :class:`UsageTap`
only frames it into SSE events to find the final usage chunk.
"""

from __future__ import annotations

import time
from array import array
from dataclasses import dataclass
from typing import Any

import orjson

from regions.edge.http.endpoints import Endpoint
from regions.edge.http.errors import EdgeError

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
#: Inputs one embeddings, pooling, score or rerank request may carry (OpenAI's embeddings
#: limit), items of a Responses ``input``, token ids one ``/detokenize`` may name.
MAX_BATCH_INPUTS = 2048
MAX_INPUT_ITEMS = 2048
MAX_DETOKENIZE_IDS = 1 << 17
#: How deep the edge looks into a pooling input for text (a part's ``text`` is at depth 3).
_MAX_DEPTH = 4
#: A client's ``cache_salt``: vLLM (0.32) takes at most 128 characters without ``@ / \\`` or NUL,
#: and the edge sends ``t:<tenant salt, 43>:<client's>`` (or ``c:<client's>``): 128 - 46.
MAX_CLIENT_SALT = 82
_SALT_FORBIDDEN = frozenset("@/\\\x00")


@dataclass(slots=True)
class ParsedRequest:
    endpoint: Endpoint
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
    #: Output tokens the request may generate: choices x ``max_tokens`` (or the default); 0
    #: for the routes that do not decode (embeddings, pooling, the tokenizer's).
    max_output_tokens: int = DEFAULT_OUTPUT_TOKENS
    #: vLLM's ``cache_salt`` as sent upstream (the client's, or the tenant's joined with it).
    cache_salt: str | None = None
    #: The decoded body of a generating request (what the edge's tokenizer reads), else None.
    doc: dict[str, Any] | None = None

    @property
    def path(self) -> str:
        """Where it goes upstream: the same endpoint it came in on."""
        return self.endpoint.path

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
        media += _content_text(content, parts)
        parts.append("\n\n")
    return "".join(parts).encode(), media


def _content_text(content: Any, parts: list[str]) -> int:
    """Append a message's (or input item's) text to ``parts``: a string, or the ``text`` of
    each part of a list; the number of other parts (images, audio) is returned."""
    if isinstance(content, str):
        parts.append(content)
        return 0
    media = 0
    if isinstance(content, list):
        for part in content:
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                parts.append(part["text"])
            else:
                media += 1
    return media


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


def _text_tokens(text: str, bytes_per_token: float) -> int:
    return int(len(text) / bytes_per_token) + 1


def input_tokens(value: Any, bytes_per_token: float, depth: int = 0) -> int:
    """Estimated tokens of a pooling or tokenizer input: texts by size, token ids one each,
    the ``text``/``content`` of parts and messages, :data:`MEDIA_PART_TOKENS` per media part."""
    if isinstance(value, str):
        return _text_tokens(value, bytes_per_token)
    if isinstance(value, int) and not isinstance(value, bool):
        return 1
    if depth >= _MAX_DEPTH:
        return 0
    if isinstance(value, list):
        return sum(input_tokens(v, bytes_per_token, depth + 1) for v in value)
    if isinstance(value, dict):
        texts = [value[k] for k in ("text", "content") if k in value]
        if not texts:
            return MEDIA_PART_TOKENS if value.get("type") not in (None, "text") else 0
        return sum(input_tokens(t, bytes_per_token, depth + 1) for t in texts)
    return 0


def _batch(value: Any, param: str) -> int:
    """How many inputs ``value`` is (a list of token ids is one), bounded."""
    if not isinstance(value, list) or not value:
        return 1
    if all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return 1
    if len(value) > MAX_BATCH_INPUTS:
        raise _bad(
            f"'{param}' may hold at most {MAX_BATCH_INPUTS} inputs", param, "too_many_inputs"
        )
    return len(value)


def _messages_tokens(messages: Any, bytes_per_token: float) -> int:
    """A conversation (or a batch of them: embeddings of chat inputs) as rendered for chat."""
    if isinstance(messages, list) and messages and all(isinstance(m, list) for m in messages):
        _batch(messages, "messages")
        return sum(_messages_tokens(m, bytes_per_token) for m in messages)
    prompt, media = render_chat(messages)
    return int(len(prompt) / bytes_per_token) + 1 + media * MEDIA_PART_TOKENS


#: Where a pooling request keeps its inputs: one side (embeddings, classify, pooling; Cohere's
#: ``/v2/embed``), or two paired sides (score, rerank) under vLLM's several names.
_ONE_SIDE = ("input", "texts", "inputs", "images")
_FIRST_SIDE = ("text_1", "query", "queries", "data_1")
_SECOND_SIDE = ("text_2", "documents", "items", "data_2")


def _pooling_tokens(doc: dict[str, Any], bytes_per_token: float) -> int:
    """Prompt tokens of an embeddings or pooling request (score and rerank: every pair)."""
    if "messages" in doc:
        return _messages_tokens(doc["messages"], bytes_per_token)
    one = [name for name in _ONE_SIDE if name in doc]
    if one:
        for name in one:
            _batch(doc[name], name)
        return sum(input_tokens(doc[name], bytes_per_token) for name in one)
    # The first side is paired with every input of the second.
    first_name = next((k for k in _FIRST_SIDE if k in doc), "query")
    second_name = next((k for k in _SECOND_SIDE if k in doc), "documents")
    first, second = doc.get(first_name), doc.get(second_name)
    n1, n2 = _batch(first, first_name), _batch(second, second_name)
    first_tokens = input_tokens(first, bytes_per_token)
    tokens = first_tokens + input_tokens(second, bytes_per_token)
    if n1 == 1 and n2 > 1:
        tokens += first_tokens * (n2 - 1)
    return tokens


def render_responses(doc: dict[str, Any]) -> tuple[bytes, int]:
    """A Responses request's ``instructions`` and ``input`` as :func:`render_chat` renders
    messages: (bytes to hash, number of non-text parts)."""
    inp = doc.get("input")
    instructions = doc.get("instructions")
    parts: list[str] = []
    if isinstance(instructions, str):
        parts.append(f"system\n{instructions}\n\n")
    if isinstance(inp, str):
        parts.append(f"user\n{inp}\n\n")
        return "".join(parts).encode(), 0
    if not isinstance(inp, list) or not inp:
        raise _bad("'input' must be a string or a non-empty array", "input", "missing_input")
    if len(inp) > MAX_INPUT_ITEMS:
        raise _bad(f"'input' may hold at most {MAX_INPUT_ITEMS} items", "input", "too_many_inputs")
    media = 0
    for item in inp:
        if not isinstance(item, dict):
            raise _bad("each input item must be an object", "input")
        role = item.get("role") or item.get("type")
        parts.append(role if isinstance(role, str) else "")
        parts.append("\n")
        content = item.get("content", item.get("output", item.get("arguments")))
        media += _content_text(content, parts)
        parts.append("\n\n")
    return "".join(parts).encode(), media


#: Responses fields that name state kept inside one engine's memory, which another instance
#: (or the same one after a restart) does not have.
_ENGINE_STATE_FIELDS = ("previous_response_id", "background")


def _generation(doc: dict[str, Any], kind: str, bytes_per_token: float) -> tuple[bytes, int, int]:
    """(prompt bytes to hash, estimated prompt tokens, output limit) of a generating route."""
    exact: int | None = None
    media = 0
    if kind == "chat":
        prompt, media = render_chat(doc.get("messages"))
        output = _output_tokens(doc)
    elif kind == "completions":
        prompt, exact = render_completion(doc.get("prompt"))
        output = _output_tokens(doc)
    else:
        for name in _ENGINE_STATE_FIELDS:
            if doc.get(name):
                raise _bad(
                    f"'{name}' is not served through the edge: a stored response lives in one "
                    "engine's memory; send the conversation in 'input'",
                    name,
                    "unsupported_field",
                )
        prompt, media = render_responses(doc)
        output = _positive_int(doc, "max_output_tokens", DEFAULT_OUTPUT_TOKENS) or 0
    tokens = exact if exact is not None else int(len(prompt) / bytes_per_token) + 1
    tokens += media * MEDIA_PART_TOKENS
    tools = doc.get("tools")
    if tools:
        # Tool schemas are rendered into the prompt by the chat template.
        tokens += int(len(orjson.dumps(tools)) / bytes_per_token)
    return prompt, tokens, output


def _other_tokens(doc: dict[str, Any], kind: str, bytes_per_token: float) -> int:
    """Estimated prompt tokens of a route that does not generate."""
    if kind == "detokenize":
        ids = doc.get("tokens")
        if not isinstance(ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in ids
        ):
            raise _bad("'tokens' must be an array of token ids", "tokens", "missing_tokens")
        if len(ids) > MAX_DETOKENIZE_IDS:
            raise _bad(f"'tokens' may hold at most {MAX_DETOKENIZE_IDS} ids", "tokens")
        return len(ids)
    if kind == "tokenize":
        if "messages" in doc:
            return _messages_tokens(doc["messages"], bytes_per_token)
        text = doc.get("prompt")
        if not isinstance(text, str):
            raise _bad("'prompt' (a string) or 'messages' is required", "prompt", "missing_prompt")
        return _text_tokens(text, bytes_per_token)
    return _pooling_tokens(doc, bytes_per_token)


def parse_request(raw: bytes, *, endpoint: Endpoint, bytes_per_token: float) -> ParsedRequest:
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
    kind = endpoint.kind
    if endpoint.generates:
        prompt, tokens, output = _generation(doc, kind, bytes_per_token)
    else:
        # Nothing to hash: pooling models' prefix caching is not what placement scores.
        prompt, tokens, output = b"", _other_tokens(doc, kind, bytes_per_token), 0
    salt = doc.get("cache_salt")
    if salt is not None and not (
        isinstance(salt, str)
        and 0 < len(salt) <= MAX_CLIENT_SALT
        and _SALT_FORBIDDEN.isdisjoint(salt)
    ):
        raise _bad(
            f"'cache_salt' must be a non-empty string of at most {MAX_CLIENT_SALT} characters "
            "without '@', '/', '\\' or NUL",
            "cache_salt",
        )
    stream = doc.get("stream") is True and endpoint.generates
    user = doc.get("user")
    body = raw
    strip = False
    if stream and kind != "responses":
        # The Responses API has no ``include_usage``: its usage is in ``response.completed``.
        opts = doc.get("stream_options")
        if not (isinstance(opts, dict) and opts.get("include_usage") is True):
            opts = dict(opts) if isinstance(opts, dict) else {}
            opts["include_usage"] = True
            doc["stream_options"] = opts
            body = orjson.dumps(doc)
            strip = True
    return ParsedRequest(
        endpoint=endpoint,
        model=model,
        prompt=prompt,
        prompt_tokens=tokens,
        stream=stream,
        body=body,
        strip_usage=strip,
        user=user if isinstance(user, str) and user else None,
        max_output_tokens=output,
        cache_salt=salt,
        doc=doc if endpoint.generates else None,
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


def _int(doc: dict[str, Any], *names: str) -> int | None:
    for name in names:
        value = doc.get(name)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def usage_numbers(usage: Any) -> tuple[int | None, int | None, int | None]:
    """(prompt_tokens, cached_tokens, completion_tokens) of a ``usage`` object: OpenAI's
    completions names, the Responses API's (``input_tokens``, ``output_tokens``), or a pooling
    route's (no completion: 0; rerank reports only ``total_tokens``, all of it prompt)."""
    if not isinstance(usage, dict):
        return None, None, None
    prompt = _int(usage, "prompt_tokens", "input_tokens")
    completion = _int(usage, "completion_tokens", "output_tokens")
    details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details")
    cached = _int(details, "cached_tokens") if isinstance(details, dict) else None
    if completion is None:
        total = _int(usage, "total_tokens")
        if prompt is None and total is not None:
            prompt, completion = total, 0
        elif prompt is not None and total is not None and total >= prompt:
            completion = total - prompt
    return prompt, cached, completion


def body_usage(body: bytes) -> tuple[int | None, int | None, int | None]:
    """Usage of a non-streamed response; parsed only when the body mentions it (``usage``, or
    Cohere's ``meta.billed_units`` on ``/v2/embed``)."""
    cohere = b'"billed_units"' in body
    if b'"usage"' not in body and not cohere:
        return None, None, None
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None, None, None
    if not isinstance(doc, dict):
        return None, None, None
    if "usage" in doc or not cohere:
        return usage_numbers(doc.get("usage"))
    meta = doc.get("meta")
    billed = meta.get("billed_units") if isinstance(meta, dict) else None
    if not isinstance(billed, dict):
        return None, None, None
    inputs = [_int(billed, name) for name in ("input_tokens", "image_tokens")]
    if all(n is None for n in inputs):
        return None, None, None
    return sum(n or 0 for n in inputs), None, 0


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

    #: The event that ends a whole stream; what counts as a relayed token's event; events that
    #: carry no token before the first one (a chat stream's role chunk).
    END: bytes = b"[DONE]"
    TOKEN_EVENT: bytes = b"data: "
    OPENING: int = 1

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

    @property
    def relayed_tokens(self) -> int:
        """Tokens the client got, as far as the events tell (a cut stream's completion)."""
        return max(self.events - self.OPENING, 0)

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
        self.events += complete.count(self.TOKEN_EVENT)
        if self.END in complete:
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
                    event = self._usage_event(event, doc)
            out.append(event)
            out.append(b"\n\n")
        return b"".join(out)

    def _usage_event(self, event: bytes, doc: dict[str, Any]) -> bytes:
        """The usage event as the client gets it (``doc``: decoded): as the engine sent it."""
        return event


#: Events that end a Responses stream (``response.completed`` has the usage, and so do these).
_RESPONSE_ENDS = frozenset({"response.completed", "response.incomplete", "response.failed"})


class ResponsesTap(UsageTap):
    """A Responses API stream (``event: <type>`` / ``data: {...}`` events, no ``[DONE]``):
    usage is read from the event that ends it (``response.completed``, ``.incomplete``,
    ``.failed``, whose ``response`` carries ``usage``), which also marks the stream whole.
    Nothing is stripped (there is no ``include_usage`` to add). ``first_token_at`` is when the
    first output text arrived: the stream opens with ``response.created`` before any prefill."""

    __slots__ = ("first_token_at", "relayed_events")

    END = b"event: response.completed\n"
    TOKEN_EVENT = b"event: response.output_text.delta\n"
    OPENING = 0

    def __init__(self) -> None:
        super().__init__(False)
        self.first_token_at: float | None = None
        #: Events passed on (the ``sequence_number`` an error event after them takes).
        self.relayed_events = 0

    def feed(self, chunk: bytes) -> bytes:
        out = super().feed(chunk)
        if out:
            self.relayed_events += out.count(b"event: ")
            if self.first_token_at is None and self.events:
                self.first_token_at = time.perf_counter()
        return out

    def _usage_events(self, complete: bytes) -> bytes:
        for event in complete.split(b"\n\n")[:-1]:
            _, sep, data = event.partition(b"data: ")
            if not sep or b'"usage"' not in data:
                continue
            try:
                doc = orjson.loads(data)
            except orjson.JSONDecodeError:
                continue
            if not isinstance(doc, dict) or doc.get("type") not in _RESPONSE_ENDS:
                continue
            self.done = True
            response = doc.get("response")
            usage = response.get("usage") if isinstance(response, dict) else None
            prompt, cached, completion = usage_numbers(usage)
            self.prompt_tokens, self.cached_tokens = prompt, cached
            self.completion_tokens = completion
        return complete
