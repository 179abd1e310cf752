"""vLLM's OpenAI-compatible HTTP API over one :class:`SimEngine`, as a bare ASGI app.

Bare ASGI rather than a framework: the zero-latency mode exists to measure a router's overhead,
so the simulator's own per-request cost must be small. Response bodies follow vLLM 0.32
field for field (``vllm/entrypoints/openai/*/serving.py``): streamed chunks are serialized
with ``exclude_unset`` there, hence the explicit ``null`` fields below; the final usage chunk
with ``exclude_none``; full responses with every field. Errors use vLLM's
``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import orjson
from prometheus_client import CONTENT_TYPE_LATEST

from regions.engines.simulator.engine import (
    VLLM_VERSION,
    ModelNotFound,
    RequestStream,
    SimEngine,
)
from regions.engines.simulator.faults import Fate
from regions.engines.simulator.http import (
    JSON_HEADERS,
    SSE_HEADERS,
    ApiError,
    Disconnected,
    Receive,
    Scope,
    Send,
    bad_request,
    bool_field,
    int_field,
    json_body,
    send_json,
    send_raw_json,
    send_text,
    until_disconnect,
    validation_error,
)
from regions.engines.simulator.kv_transfer import READ_PATH, request_params
from regions.engines.simulator.pooling import PoolingApi
from regions.engines.simulator.responses import ResponsesFormatter, responses_messages
from regions.engines.simulator.scheduler import Request, Status
from regions.engines.simulator.tokenizer import MAX_CHARS_PER_TOKEN

DONE = b"data: [DONE]\n\n"
CUT_MESSAGE = "ASGI callable returned without completing response."

_ids = random.Random()


class CutConnectionFilter(logging.Filter):
    """Silence uvicorn's complaint about responses the simulator cuts on purpose (die
    mid-stream, kill); any other incomplete response is still logged."""

    def __init__(self) -> None:
        super().__init__()
        self.expected = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if self.expected > 0 and record.getMessage() == CUT_MESSAGE:
            self.expected -= 1
            return False
        return True


CUT_FILTER = CutConnectionFilter()


@dataclass(frozen=True, slots=True)
class _Generation:
    """A chat or completions request once its endpoint's own fields are read: what the path
    both share (``EngineApp._generate``) starts from."""

    body: dict[str, Any]
    fate: Fate
    #: The name the client used (echoed in the response) and the adapter it resolves to.
    model: str
    lora: str | None
    prompt_ids: list[int]
    #: As the client asked (None: up to the context limit), and its parameter's name.
    max_tokens: int | None
    max_tokens_param: str
    chat: bool
    #: A Responses API request (``responses.py`` formats its answer).
    responses: bool = False


@dataclass(frozen=True, slots=True)
class _ResponseShape:
    """How the answer goes out: streamed or whole, with usage chunks or not."""

    stream: bool
    include_usage: bool
    continuous: bool


def _response_shape(body: dict[str, Any]) -> _ResponseShape:
    """``n``, ``stream`` and ``stream_options``, checked as vLLM checks them."""
    n = int_field(body, "n")
    if n is not None and n != 1:
        raise bad_request("the simulator generates one choice per request (n=1)", "n")
    stream = bool_field(body, "stream", False)
    options = body.get("stream_options")
    if options is not None:
        if not stream:
            raise bad_request("Stream options can only be defined when `stream=True`.")
        if not isinstance(options, dict):
            raise validation_error(
                "model_type", "body.stream_options", "Input should be an object", options
            )
    include_usage = bool(options and options.get("include_usage"))
    continuous = include_usage and bool(options and options.get("continuous_usage_stats"))
    return _ResponseShape(stream, include_usage, continuous)


def _cache_salt(body: dict[str, Any]) -> str | None:
    """vLLM's ``cache_salt``: 1 to 1024 characters, or absent."""
    value = body.get("cache_salt")
    if value is None:
        return None
    if isinstance(value, str) and 0 < len(value) <= 1024:
        return value
    raise validation_error(
        "string_type", "body.cache_salt", "Input should be a valid string", value
    )


def _kv_transfer_params(body: dict[str, Any]) -> dict[str, Any] | None:
    """The P/D ``kv_transfer_params``; a non-object is refused as pydantic refuses it."""
    try:
        return request_params(body)
    except ValueError:
        raise validation_error(
            "dict_type",
            "body.kv_transfer_params",
            "Input should be a valid dictionary",
            body["kv_transfer_params"],
        ) from None


class EngineApp:
    """ASGI app of one engine; ``on_kill`` stops its listener."""

    def __init__(self, engine: SimEngine, on_kill: Callable[[], None] | None = None):
        self.engine = engine
        self.on_kill = on_kill
        self.routes: dict[str, tuple[str, Callable[[Scope, Receive, Send], Awaitable[None]]]] = {
            "/v1/chat/completions": ("POST", self.chat_completions),
            "/v1/completions": ("POST", self.completions),
            "/v1/models": ("GET", self.models),
            "/health": ("GET", self.health),
            "/metrics": ("GET", self.metrics),
            "/version": ("GET", self.version),
            "/v1/load_lora_adapter": ("POST", self.load_lora),
            "/v1/unload_lora_adapter": ("POST", self.unload_lora),
            "/reset_prefix_cache": ("POST", self.reset_prefix_cache),
            "/admin/faults": ("*", self.admin_faults),
            READ_PATH: ("POST", self.kv_read),
            "/v1/responses": ("POST", self.responses),
        }
        for path, handler in PoolingApi(engine, self._model).routes().items():
            self.routes[path] = ("POST", handler)
        names = engine.served_model_names
        self._model_json = {name: orjson.dumps(name).decode() for name in names}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        if self.engine.killed:
            # Accepted in the instant between the kill and the listener closing: a dead
            # process answers nothing; drop the connection.
            CUT_FILTER.expected += 1
            headers = [(b"content-length", b"1")]
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            return
        route = self.routes.get(scope["path"])
        if route is None:
            await send_json(send, 404, {"detail": "Not Found"})
            return
        method, handler = route
        if method != "*" and scope["method"] != method:
            await send_json(send, 405, {"detail": "Method Not Allowed"})
            return
        try:
            await handler(scope, receive, send)
        except ApiError as err:
            await send_json(send, err.status, err.body)

    # -- simple endpoints ----------------------------------------------------------------

    async def health(self, scope: Scope, receive: Receive, send: Send) -> None:
        status = 503 if self.engine.faults.config.health_fail else 200
        headers = [(b"content-length", b"0")]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": b""})

    async def version(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send_json(send, 200, {"version": VLLM_VERSION})

    async def metrics(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = self.engine.metrics_text()
        headers = [(b"content-type", CONTENT_TYPE_LATEST.encode())]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    async def models(self, scope: Scope, receive: Receive, send: Send) -> None:
        engine = self.engine
        created = int(time.time())
        cards = [
            _model_card(name, engine.config.model, None, engine.max_model_len, created)
            for name in engine.served_model_names
        ]
        cards += [
            _model_card(name, path, engine.served_model_names[0], None, created)
            for name, path in engine.loras.items()
        ]
        await send_json(send, 200, {"object": "list", "data": cards})

    async def reset_prefix_cache(self, scope: Scope, receive: Receive, send: Send) -> None:
        """vLLM's dev endpoint (benchmarks start cold): 200 either way; the cache is only
        dropped when no request holds blocks, as in vLLM."""
        self.engine.kv.reset_prefix_cache()
        await send_text(send, 200, "")

    async def kv_read(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Simulator side channel (``kv_transfer.py``): a decode engine reads a held prefill's
        blocks; 404 when this engine holds nothing under that id (expired, or restarted)."""
        body = await json_body(scope, receive)
        tokens = self.engine.read_held(body.get("remote_engine_id"), body.get("remote_request_id"))
        if tokens is None:
            await send_json(send, 404, {"detail": "no such held request"})
            return
        await send_json(send, 200, {"num_tokens": tokens})

    async def load_lora(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = await json_body(scope, receive)
        name, path = body.get("lora_name"), body.get("lora_path")
        if not name or not path or not isinstance(name, str) or not isinstance(path, str):
            raise ApiError(
                400, "Both 'lora_name' and 'lora_path' must be provided.", "InvalidUserInput"
            )
        engine = self.engine
        if name in engine.served_model_names:
            raise ApiError(
                400,
                f"The lora adapter '{name}' conflicts with a served base model.",
                "InvalidUserInput",
            )
        if name in engine.loras and not body.get("load_inplace"):
            raise ApiError(
                400,
                f"The lora adapter '{name}' has already been loaded. If you want to load the "
                "adapter in place, set 'load_inplace' to True.",
                "InvalidUserInput",
            )
        engine.load_lora(name, path)
        await send_text(send, 200, f"Success: LoRA adapter '{name}' added successfully.")

    async def unload_lora(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = await json_body(scope, receive)
        name = body.get("lora_name")
        if not name or not isinstance(name, str):
            raise ApiError(
                400,
                "'lora_name' needs to be provided to unload a LoRA adapter.",
                "InvalidUserInput",
            )
        if name not in self.engine.loras:
            raise ApiError(404, f"The lora adapter '{name}' cannot be found.", "NotFoundError")
        del self.engine.loras[name]
        await send_text(send, 200, f"Success: LoRA adapter '{name}' removed successfully.")

    async def admin_faults(self, scope: Scope, receive: Receive, send: Send) -> None:
        engine = self.engine
        kill = False
        if scope["method"] == "POST":
            body = await json_body(scope, receive)
            update = dict(body)
            kill = bool(update.pop("kill", False))
            if update.pop("reset", False):
                engine.faults.reset()
            try:
                engine.faults.update(update)
            except ValueError as exc:
                raise bad_request(str(exc)) from None
        elif scope["method"] != "GET":
            await send_json(send, 405, {"detail": "Method Not Allowed"})
            return
        await send_json(
            send,
            200,
            {
                "engine": engine.index,
                "faults": engine.faults.config.as_dict(),
                "killed": engine.killed or kill,
            },
        )
        if kill:
            # After the answer went out: stop listening and cut every open response.
            asyncio.get_running_loop().call_soon(self.kill)

    def kill(self) -> None:
        CUT_FILTER.expected += len(self.engine.streams)
        self.engine.kill()
        if self.on_kill is not None:
            self.on_kill()

    # -- generation ----------------------------------------------------------------------

    async def chat_completions(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = await json_body(scope, receive)
        fate = self.engine.faults.fate()
        if fate.latency_s or fate.error or fate.hang:
            await self._apply_fate(fate, receive, send)
        messages = body.get("messages")
        if messages is None:
            raise validation_error("missing", "body.messages", "Field required", body)
        if not isinstance(messages, list):
            raise validation_error(
                "list_type", "body.messages", "Input should be a valid list", messages
            )
        for i, message in enumerate(messages):
            if not isinstance(message, dict):
                raise validation_error(
                    "model_type", f"body.messages.{i}", "Input should be an object", message
                )
        model, lora = self._model(body)
        add_generation_prompt = bool_field(body, "add_generation_prompt", True)
        prompt_ids = self._real_chat_ids(messages, add_generation_prompt)
        if prompt_ids is None:
            try:
                rendered = self.engine.tokenizer.apply_chat_template(
                    messages, add_generation_prompt
                )
            except ValueError as exc:
                raise bad_request(str(exc)) from None
            self._check_chars(rendered)
            prompt_ids = self.engine.tokenizer.encode(rendered)
        max_tokens = int_field(body, "max_completion_tokens")
        param = "max_completion_tokens"
        if max_tokens is None:
            max_tokens, param = int_field(body, "max_tokens"), "max_tokens"
        generation = _Generation(body, fate, model, lora, prompt_ids, max_tokens, param, chat=True)
        await self._generate(scope, receive, send, generation)

    async def completions(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = await json_body(scope, receive)
        fate = self.engine.faults.fate()
        if fate.latency_s or fate.error or fate.hang:
            await self._apply_fate(fate, receive, send)
        prompt = body.get("prompt")
        if prompt is None:
            raise validation_error("missing", "body.prompt", "Field required", body)
        model, lora = self._model(body)
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            self._check_chars(prompt)
            real = self.engine.prompt_tokenizer
            if real is not None:  # vLLM adds the special tokens to a completion's prompt
                prompt_ids = list(real.encode(prompt, add_special_tokens=True).ids)
            else:
                prompt_ids = self.engine.tokenizer.encode(prompt)
        elif isinstance(prompt, list) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt
        ):
            prompt_ids = list(prompt)
        else:
            raise bad_request(
                "the simulator serves one prompt per request: a string or a list of token ids",
                "prompt",
            )
        if not prompt_ids:
            raise bad_request("Prompt cannot be empty", "prompt")
        max_tokens = int_field(body, "max_tokens")
        if "max_tokens" not in body:
            max_tokens = 16  # vLLM's CompletionRequest default
        generation = _Generation(
            body, fate, model, lora, prompt_ids, max_tokens, "max_tokens", chat=False
        )
        await self._generate(scope, receive, send, generation)

    async def responses(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = await json_body(scope, receive)
        fate = self.engine.faults.fate()
        if fate.latency_s or fate.error or fate.hang:
            await self._apply_fate(fate, receive, send)
        model, lora = self._model(body)
        try:
            messages = responses_messages(body)
            rendered = self.engine.tokenizer.apply_chat_template(messages, True)
        except ValueError as exc:
            raise bad_request(str(exc), "input") from None
        self._check_chars(rendered)
        prompt_ids = self.engine.tokenizer.encode(rendered)
        max_tokens = int_field(body, "max_output_tokens")
        generation = _Generation(
            body,
            fate,
            model,
            lora,
            prompt_ids,
            max_tokens,
            "max_output_tokens",
            chat=False,
            responses=True,
        )
        await self._generate(scope, receive, send, generation)

    def _real_chat_ids(self, messages: list[Any], add_generation_prompt: bool) -> list[int] | None:
        """The prompt ids under ``--tokenizer`` (the model's template and tokenizer, as vLLM
        renders them); None without one, or for what it does not render (non-text parts)."""
        real = self.engine.prompt_tokenizer
        if real is None:
            return None
        doc = {"messages": messages, "add_generation_prompt": add_generation_prompt}
        prompt = real.chat_ids(doc)
        return list(prompt.ids) if prompt is not None else None

    def _check_chars(self, text: str) -> None:
        """vLLM's cheap pre-check: text longer than limit x longest token cannot fit."""
        limit = self.engine.max_model_len
        bound = limit * MAX_CHARS_PER_TOKEN
        if len(text) > bound:
            raise ApiError(
                400,
                f"This model's maximum context length is {limit} tokens. However, your prompt "
                f"contains {len(text)} characters (more than {bound} characters, which is the "
                f"upper bound for {limit} input tokens). Please reduce the length of the input "
                f"prompt. (parameter=input_text, value={len(text)})",
                "BadRequestError",
                "input_text",
            )

    def _model(self, body: dict[str, Any]) -> tuple[str, str | None]:
        name = body.get("model")
        if name is not None and not isinstance(name, str):
            raise validation_error(
                "string_type", "body.model", "Input should be a valid string", name
            )
        try:
            lora = self.engine.resolve_model(name)
        except ModelNotFound:
            aliases = ", ".join(self.engine.served_model_names)
            raise ApiError(
                404,
                f"The model `{name}` does not exist. Valid aliases: {aliases}.",
                "NotFoundError",
                "model",
            ) from None
        return (name or self.engine.served_model_names[0]), lora

    async def _apply_fate(self, fate: Fate, receive: Receive, send: Send) -> None:
        if fate.latency_s:
            await asyncio.sleep(fate.latency_s)
        if fate.error:
            raise ApiError(
                500,
                "EngineCore encountered an issue. See stack trace (above) for the root cause.",
                "InternalServerError",
            )
        if fate.hang:
            gone = asyncio.ensure_future(until_disconnect(receive))
            killed = asyncio.ensure_future(self.engine.killed_event.wait())
            try:
                await asyncio.wait((gone, killed), return_when=asyncio.FIRST_COMPLETED)
            finally:
                gone.cancel()
                killed.cancel()
            if self.engine.killed:
                # Died while hanging: headers, then the connection drops.
                CUT_FILTER.expected += 1
                await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
            raise Disconnected

    async def _generate(
        self, scope: Scope, receive: Receive, send: Send, generation: _Generation
    ) -> None:
        """What chat and completions share: check the rest of the body, plan the answer and
        send it, whole or streamed, as the engine produces it."""
        engine = self.engine
        shape = _response_shape(generation.body)
        max_tokens = self._max_output_tokens(generation)
        request, texts = await self._new_request(generation, max_tokens)
        chat = generation.chat
        fmt: _Formatter | ResponsesFormatter
        if generation.responses:
            fmt = ResponsesFormatter(generation.model, generation.body, len(generation.prompt_ids))
        else:
            fmt = _Formatter(
                _request_id(scope, generation.body, "chatcmpl-" if chat else "cmpl-"),
                int(time.time()),
                self._model_json.get(generation.model) or orjson.dumps(generation.model).decode(),
                engine.system_fingerprint,
                chat,
                len(generation.prompt_ids),
                shape.include_usage,
                shape.continuous,
            )
        handle = engine.submit(request, texts)
        fate = generation.fate
        if engine.config.zero_latency and fate.die_after_tokens is None:
            # Everything is known: one body, no engine loop, no disconnect watcher.
            await _send_at_once(send, fmt, request, texts, shape.stream)
            return
        watcher = asyncio.ensure_future(_abort_on_disconnect(receive, engine, request.request_id))
        try:
            if shape.stream:
                await self._stream(send, handle, fmt, fate)
            else:
                await self._full(send, handle, fmt, fate)
        finally:
            watcher.cancel()

    def _max_output_tokens(self, generation: _Generation) -> int:
        """The answer's length limit: what the client asked, capped by the context the prompt
        leaves; vLLM's 400 when either does not fit."""
        limit = self.engine.max_model_len
        num_prompt = len(generation.prompt_ids)
        max_tokens = generation.max_tokens
        if max_tokens is not None and max_tokens > limit:
            param = generation.max_tokens_param
            raise bad_request(
                f"{param}={max_tokens} cannot be greater than max_model_len={limit}. "
                "Please request fewer output tokens.",
                param,
            )
        if num_prompt > limit:
            # vLLM tokenizes with truncation to limit + 1, hence "at least".
            raise ApiError(
                400,
                f"This model's maximum context length is {limit} tokens. However, your prompt "
                f"contains at least {limit + 1} input tokens, which exceeds this limit even "
                "without any output tokens. Please reduce the length of the input prompt. "
                f"(parameter=input_tokens, value={limit + 1})",
                "BadRequestError",
                "input_tokens",
            )
        effective = (
            limit - num_prompt if max_tokens is None else min(max_tokens, limit - num_prompt)
        )
        if effective < 1:
            raise bad_request(f"max_tokens must be at least 1, got {effective}.", "max_tokens")
        return effective

    async def _new_request(
        self, generation: _Generation, max_tokens: int
    ) -> tuple[Request, list[str]]:
        """The engine's request and its planned answer texts, from the sampling fields; a
        P/D leg is prepared before the engine sees it."""
        body = generation.body
        min_tokens = int_field(body, "min_tokens") or 0
        ignore_eos = bool_field(body, "ignore_eos", False)
        cache_salt = _cache_salt(body)
        kv_params = _kv_transfer_params(body)
        request, texts = self.engine.new_request(
            generation.prompt_ids,
            max_tokens,
            lora=generation.lora,
            ignore_eos=ignore_eos,
            min_tokens=min_tokens,
            cache_salt=cache_salt,
        )
        if kv_params is not None:
            await self._join_transfer(request, kv_params)
        return request, texts

    async def _join_transfer(self, request: Request, kv_params: dict[str, Any]) -> None:
        """P/D disaggregation by this engine's KV role: a prefill leg holds its blocks for
        the decode engine; a decode leg reads the prefill engine's blocks first. Zero-latency
        engines ignore it."""
        engine = self.engine
        if engine.config.zero_latency:
            return
        kv = engine.config.kv_transfer
        if kv.producer and kv_params.get("do_remote_decode"):
            request.hold_on_finish = True
        elif kv.consumer and kv_params.get("do_remote_prefill"):
            # Before the engine sees the request, as vLLM's WAITING_FOR_REMOTE_KVS: the
            # transfer counts in its TTFT and queue time, not in any engine step.
            request.num_external_tokens = await engine.load_remote_kv(kv_params)

    async def _stream(
        self,
        send: Send,
        handle: RequestStream,
        fmt: _Formatter | ResponsesFormatter,
        fate: Fate,
    ) -> None:
        request = handle.request
        die_at = fate.die_after_tokens
        await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
        # As vLLM: a chat stream's opening role chunk goes with the first token, once the
        # prompt is prefilled (vLLM sends it on the engine's first output), not before.
        opening = fmt.opening()
        if fmt.eager:
            # A Responses stream says it was created before any token.
            await send({"type": "http.response.body", "body": opening, "more_body": True})
            opening = b""
        sent = 0
        while True:
            n = len(request.output_token_ids)
            if die_at is not None and n >= die_at:
                if die_at > sent:
                    chunk = opening + fmt.token_chunks(handle.texts, sent, die_at, request)
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                self._cut(request)
                return
            if handle.cut or request.finish_reason == "abort":
                return  # killed, or the client left: the connection is gone
            if n > sent:
                chunk = opening + fmt.token_chunks(handle.texts, sent, n, request)
                opening = b""
                sent = n
                if request.status is Status.FINISHED:
                    tail = [chunk]
                    if fmt.include_usage:
                        tail.append(fmt.usage_chunk(request))
                    tail.append(fmt.done)
                    await send({"type": "http.response.body", "body": b"".join(tail)})
                    return
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await handle.wait()

    async def _full(
        self, send: Send, handle: RequestStream, fmt: _Formatter | ResponsesFormatter, fate: Fate
    ) -> None:
        request = handle.request
        die_at = fate.die_after_tokens
        while request.status is not Status.FINISHED and not handle.cut:
            if die_at is not None and len(request.output_token_ids) >= die_at:
                break
            await handle.wait()
        if handle.cut:
            # The engine died: headers promising a body, then the connection drops (an ASGI
            # app cannot reset a connection before its response starts).
            headers = [*JSON_HEADERS, (b"content-length", b"1")]
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            return
        if request.finish_reason == "abort":
            return  # the client left
        body = fmt.full_response(request, handle.texts, self.engine.transfer_params(request))
        if die_at is not None and len(request.output_token_ids) >= die_at:
            # Promise the whole body, deliver half, hang up.
            headers = [*JSON_HEADERS, (b"content-length", str(len(body)).encode())]
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            await send(
                {"type": "http.response.body", "body": body[: len(body) // 2], "more_body": True}
            )
            self._cut(request)
            return
        await send_raw_json(send, body)

    def _cut(self, request: Request) -> None:
        CUT_FILTER.expected += 1
        self.engine.abort(request.request_id)


class _Formatter:
    """Pre-rendered pieces of one response's JSON; chunks are assembled as bytes."""

    __slots__ = (
        "chat",
        "continuous",
        "fingerprint",
        "full_head",
        "head",
        "include_usage",
        "num_prompt",
        "tail_fp",
    )

    def __init__(
        self,
        rid: str,
        created: int,
        model_json: str,
        fingerprint: str,
        chat: bool,
        num_prompt: int,
        include_usage: bool = False,
        continuous: bool = False,
    ):
        self.include_usage = include_usage
        self.continuous = continuous
        obj = "chat.completion.chunk" if chat else "text_completion"
        self.head = (
            f'data: {{"id":"{rid}","object":"{obj}","created":{created},'
            f'"model":{model_json},"choices":['
        )
        full_obj = "chat.completion" if chat else "text_completion"
        self.full_head = (
            f'{{"id":"{rid}","object":"{full_obj}","created":{created},"model":{model_json},'
        )
        self.fingerprint = fingerprint
        self.tail_fp = f',"system_fingerprint":"{fingerprint}"'
        self.chat = chat
        self.num_prompt = num_prompt

    #: Chat and completions streams start with their first token, and end with ``[DONE]``.
    eager = False
    done = DONE

    def opening(self) -> bytes:
        """What a stream starts with: a chat stream's role chunk (with the first token)."""
        return self.first_chunk() if self.chat else b""

    def first_chunk(self) -> bytes:
        usage = self._usage(0) if self.continuous else ""
        return (
            self.head + '{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,'
            f'"finish_reason":null}}]{usage},"prompt_token_ids":null,"prompt_text":null}}\n\n'
        ).encode()

    def _usage(self, k: int) -> str:
        """``continuous_usage_stats``: chat also sends ``completion_tokens_details``."""
        p = self.num_prompt
        details = ',"completion_tokens_details":null' if self.chat else ""
        return (
            f',"usage":{{"prompt_tokens":{p},"total_tokens":{p + k},"completion_tokens":{k}'
            f"{details}}}"
        )

    def token_chunks(self, texts: list[str], start: int, end: int, request: Request) -> bytes:
        head = self.head
        continuous = self.continuous
        # vLLM stamps the fingerprint on the terminal chunk unless a usage chunk follows.
        final_fp = "" if self.include_usage else self.tail_fp
        last = len(texts) - 1 if request.status is Status.FINISHED else -1
        out = []
        for i in range(start, end):
            text = orjson.dumps(texts[i]).decode()
            piece = f'{{"content":{text}}}' if self.chat else None
            if i == last:
                reason = request.finish_reason
                if self.chat:
                    choice = (
                        f'{{"index":0,"delta":{piece},"logprobs":null,"finish_reason":"{reason}",'
                        '"stop_reason":null,"token_ids":null}]'
                    )
                else:
                    choice = (
                        f'{{"index":0,"text":{text},"logprobs":null,"finish_reason":"{reason}",'
                        '"stop_reason":null,"prompt_token_ids":null,"token_ids":null}]'
                    )
            elif self.chat:
                choice = (
                    f'{{"index":0,"delta":{piece},"logprobs":null,"finish_reason":null,'
                    '"token_ids":null}]'
                )
            else:
                choice = (
                    f'{{"index":0,"text":{text},"logprobs":null,"finish_reason":null,'
                    '"stop_reason":null,"prompt_token_ids":null,"token_ids":null}]'
                )
            usage = self._usage(i + 1) if continuous else ""
            fp = final_fp if i == last else ""
            out.append(f"{head}{choice}{usage}{fp}}}\n\n")
        return "".join(out).encode()

    def usage_chunk(self, request: Request) -> bytes:
        c = len(request.output_token_ids)
        p = self.num_prompt
        cached = max(request.num_cached_tokens, 0)
        # Chat reports created_cache_tokens (0), completions do not (vLLM 0.32 captures).
        created = ',"created_cache_tokens":0' if self.chat else ""
        return (
            f'{self.head}],"usage":{{"prompt_tokens":{p},"total_tokens":{p + c},'
            f'"completion_tokens":{c},"prompt_tokens_details":{{"cached_tokens":{cached}'
            f"{created}}}}}{self.tail_fp}}}\n\n"
        ).encode()

    def full_response(
        self, request: Request, texts: list[str], kv_params: dict[str, Any] | None = None
    ) -> bytes:
        text = orjson.dumps("".join(texts)).decode()
        kv = orjson.dumps(kv_params).decode()
        reason = request.finish_reason
        if self.chat:
            choice = (
                f'{{"index":0,"message":{{"role":"assistant","content":{text},"refusal":null,'
                '"annotations":null,"audio":null,"function_call":null,"reasoning":null},'
                f'"logprobs":null,"finish_reason":"{reason}","stop_reason":null,'
                '"token_ids":null,"routed_experts":null}'
            )
            extra = (
                '"prompt_logprobs":null,"prompt_token_ids":null,"prompt_text":null,'
                f'"kv_transfer_params":{kv},"ec_transfer_params":null,"metrics":null}}'
            )
        else:
            choice = (
                f'{{"index":0,"text":{text},"logprobs":null,"finish_reason":"{reason}",'
                '"stop_reason":null,"token_ids":null,"prompt_logprobs":null,'
                '"prompt_token_ids":null,"routed_experts":null}'
            )
            extra = f'"kv_transfer_params":{kv},"ec_transfer_params":null,"metrics":null}}'
        c = len(request.output_token_ids)
        p = self.num_prompt
        cached = max(request.num_cached_tokens, 0)
        created = "0" if self.chat else "null"
        usage = (
            f'{{"prompt_tokens":{p},"total_tokens":{p + c},"completion_tokens":{c},'
            f'"prompt_tokens_details":{{"cached_tokens":{cached},"created_cache_tokens":'
            f'{created},"multimodal_tokens":null}},"completion_tokens_details":null}}'
        )
        return (
            f'{self.full_head}"choices":[{choice}],"service_tier":null,'
            f'"system_fingerprint":"{self.fingerprint}","usage":{usage},{extra}'
        ).encode()


def _request_id(scope: Scope, body: dict[str, Any], prefix: str) -> str:
    headers: list[tuple[bytes, bytes]] = scope["headers"]
    for key, value in headers:
        if key == b"x-request-id":
            return prefix + value.decode("latin-1")
    given = body.get("request_id")
    if isinstance(given, str) and given:
        return prefix + given
    return f"{prefix}{_ids.getrandbits(64):016x}"


def _model_card(
    name: str, root: str, parent: str | None, max_model_len: int | None, created: int
) -> dict[str, Any]:
    return {
        "id": name,
        "object": "model",
        "created": created,
        "owned_by": "vllm",
        "root": root,
        "parent": parent,
        "max_model_len": max_model_len,
        "permission": [
            {
                "id": f"modelperm-{_ids.getrandbits(64):016x}",
                "object": "model_permission",
                "created": created,
                "allow_create_engine": False,
                "allow_sampling": True,
                "allow_logprobs": True,
                "allow_search_indices": False,
                "allow_view": True,
                "allow_fine_tuning": False,
                "organization": "*",
                "group": None,
                "is_blocking": False,
            }
        ],
    }


async def _abort_on_disconnect(receive: Receive, engine: SimEngine, request_id: str) -> None:
    await until_disconnect(receive)
    engine.abort(request_id)


async def _send_at_once(
    send: Send,
    fmt: _Formatter | ResponsesFormatter,
    request: Request,
    texts: list[str],
    stream: bool,
) -> None:
    """A finished answer (zero-latency mode) as one body, streamed or not."""
    if stream:
        out = [fmt.opening(), fmt.token_chunks(texts, 0, len(texts), request)]
        if fmt.include_usage:
            out.append(fmt.usage_chunk(request))
        out.append(fmt.done)
        await _send_stream_once(send, b"".join(out))
    else:
        await send_raw_json(send, fmt.full_response(request, texts))


async def _send_stream_once(send: Send, body: bytes) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
    await send({"type": "http.response.body", "body": body})
