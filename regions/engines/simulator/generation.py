"""vLLM's generation routes over one :class:`SimEngine`: ``/v1/chat/completions``,
``/v1/completions`` and ``/v1/responses``.

Each endpoint reads its own fields into a :class:`_Generation`; the path they share checks the
rest, submits the request and sends the answer whole or streamed as the engine produces it,
playing the injected faults (latency, errors, hangs, dying mid-answer). Apart from ``server``
(routing and the small endpoints) because it is most of the simulator's HTTP behaviour; the
bodies themselves are built in ``openai_protocol`` (chat and completions) and ``responses``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import orjson

from regions.engines.prompt_tokens import ModelTokenizer
from regions.engines.simulator.engine import RequestStream, SimEngine
from regions.engines.simulator.faults import Fate
from regions.engines.simulator.http import (
    CUT_FILTER,
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
    send_raw_json,
    until_disconnect,
    validation_error,
)
from regions.engines.simulator.openai_protocol import (
    CompletionFormatter,
    cache_salt_field,
    check_generation_prompt,
    kv_transfer_params_field,
    response_id,
    response_shape,
)
from regions.engines.simulator.pooling import ModelOf
from regions.engines.simulator.responses import ResponsesFormatter, responses_messages
from regions.engines.simulator.scheduler import Request, Status
from regions.engines.simulator.tokenizer import (
    CONTINUE_WITH_GENERATION_PROMPT,
    MAX_CHARS_PER_TOKEN,
    message_text,
    open_final_message,
)

Handler = Callable[[Scope, Receive, Send], Awaitable[None]]


@dataclass(frozen=True, slots=True)
class _Generation:
    """A chat or completions request once its endpoint's own fields are read: what the path
    both share (``GenerationApi._generate``) starts from."""

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


class GenerationApi:
    """The routes; ``model_of`` resolves a body's ``model`` as the engine app does (404)."""

    def __init__(self, engine: SimEngine, model_of: ModelOf) -> None:
        self.engine = engine
        self.model_of = model_of
        names = engine.served_model_names
        self._model_json = {name: orjson.dumps(name).decode() for name in names}

    def routes(self) -> dict[str, Handler]:
        return {
            "/v1/chat/completions": self.chat_completions,
            "/v1/completions": self.completions,
            "/v1/responses": self.responses,
        }

    async def chat_completions(self, scope: Scope, receive: Receive, send: Send) -> None:
        body, fate = await self._request(scope, receive, send)
        check_generation_prompt(body)  # a validator that runs before the fields' own
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
        model, lora = self.model_of(body)
        prompt_ids = self._chat_prompt_ids(body, messages)
        max_tokens = int_field(body, "max_completion_tokens")
        param = "max_completion_tokens"
        if max_tokens is None:
            max_tokens, param = int_field(body, "max_tokens"), "max_tokens"
        generation = _Generation(body, fate, model, lora, prompt_ids, max_tokens, param, chat=True)
        await self._generate(scope, receive, send, generation)

    async def completions(self, scope: Scope, receive: Receive, send: Send) -> None:
        body, fate = await self._request(scope, receive, send)
        prompt = body.get("prompt")
        if prompt is None:
            raise validation_error("missing", "body.prompt", "Field required", body)
        model, lora = self.model_of(body)
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
        body, fate = await self._request(scope, receive, send)
        model, lora = self.model_of(body)
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

    def _chat_prompt_ids(self, body: dict[str, Any], messages: list[Any]) -> list[int]:
        """The chat template applied to the messages and tokenized, as vLLM does, with
        ``add_generation_prompt`` and ``continue_final_message`` (the final message left open
        for the model to continue: what a resumed answer is sent as); a rendering the template
        refuses is a 400 ``BadRequestError`` with its text."""
        add_generation_prompt = bool_field(body, "add_generation_prompt", True)
        continue_final = bool_field(body, "continue_final_message", False)
        tokenizer = self.engine.tokenizer
        try:
            prompt_ids = self._real_chat_ids(messages, add_generation_prompt, continue_final)
            if prompt_ids is not None:
                return prompt_ids
            rendered = tokenizer.apply_chat_template(
                messages, add_generation_prompt, continue_final_message=continue_final
            )
        except ValueError as exc:
            raise bad_request(str(exc)) from None
        self._check_chars(rendered)
        return tokenizer.encode(rendered)

    def _real_chat_ids(
        self, messages: list[Any], add_generation_prompt: bool, continue_final: bool = False
    ) -> list[int] | None:
        """The prompt ids under ``--tokenizer`` (the model's template and tokenizer, as vLLM
        renders them); None without one, or for what it does not render (non-text parts)."""
        real = self.engine.prompt_tokenizer
        if real is None:
            return None
        if continue_final:
            return _real_open_chat_ids(real, messages, add_generation_prompt)
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

    async def _request(
        self, scope: Scope, receive: Receive, send: Send
    ) -> tuple[dict[str, Any], Fate]:
        """What every generation endpoint starts with: the JSON body, then the request's fate
        (an injected delay, error or hang) acted on before the body is read further."""
        body = await json_body(scope, receive)
        fate = self.engine.faults.fate()
        if fate.latency_s or fate.error or fate.hang:
            await self._apply_fate(fate, receive, send)
        return body, fate

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
        shape = response_shape(generation.body)
        max_tokens = self._max_output_tokens(generation)
        request, texts = await self._new_request(generation, max_tokens)
        chat = generation.chat
        fmt: CompletionFormatter | ResponsesFormatter
        if generation.responses:
            fmt = ResponsesFormatter(generation.model, generation.body, len(generation.prompt_ids))
        else:
            fmt = CompletionFormatter(
                response_id(scope, generation.body, "chatcmpl-" if chat else "cmpl-"),
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
        cache_salt = cache_salt_field(body)
        kv_params = kv_transfer_params_field(body)
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
        fmt: CompletionFormatter | ResponsesFormatter,
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
        self,
        send: Send,
        handle: RequestStream,
        fmt: CompletionFormatter | ResponsesFormatter,
        fate: Fate,
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


def _real_open_chat_ids(
    real: ModelTokenizer, messages: list[Any], add_generation_prompt: bool
) -> list[int] | None:
    """``continue_final_message`` under ``--tokenizer``: the model's template rendered without
    generation prompt, its final message left open as transformers leaves it, tokenized as
    :meth:`ModelTokenizer.chat_ids` tokenizes; None where ``chat_ids`` would not render.

    ``ModelTokenizer`` (shared with the edge, which does not render continuations: it leaves
    them to the byte estimate) gives ids, not text, so its template is called here directly,
    with the conversation ``chat_ids`` builds (role, text, name)."""
    if add_generation_prompt:
        raise ValueError(CONTINUE_WITH_GENERATION_PROMPT)
    if real.chat_ids({"messages": messages, "add_generation_prompt": False}) is None:
        return None  # tools, non-text parts, a refusing template: the built-in rendering
    render = real._render
    assert render is not None  # chat_ids rendered
    conversation = []
    for m in messages:
        turn = {"role": m["role"], "content": message_text(m.get("content"))}
        if isinstance(m.get("name"), str):
            turn["name"] = m["name"]
        conversation.append(turn)
    text = render(messages=conversation, add_generation_prompt=False, **real._specials)
    return list(real.encode_chat(open_final_message(text, conversation)).ids)


async def _abort_on_disconnect(receive: Receive, engine: SimEngine, request_id: str) -> None:
    await until_disconnect(receive)
    engine.abort(request_id)


async def _send_at_once(
    send: Send,
    fmt: CompletionFormatter | ResponsesFormatter,
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
