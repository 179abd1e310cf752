"""vLLM's OpenAI protocol for chat and completions, without I/O: the request fields the
generation path checks as vLLM's pydantic models do, and the answer as bytes.

Apart from ``generation.py`` (which runs requests and sends) so that the field-for-field shapes
read on their own. Bodies follow vLLM 0.32 (``vllm/entrypoints/openai/*/serving.py``):
streamed chunks are serialized with ``exclude_unset`` there, hence the explicit ``null``
fields below; the final usage chunk with ``exclude_none``; full responses with every field.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import orjson

from regions.engines.simulator.http import (
    ApiError,
    Scope,
    bad_request,
    bool_field,
    int_field,
    validation_error,
)
from regions.engines.simulator.kv_transfer import request_params
from regions.engines.simulator.scheduler import Request, Status

DONE = b"data: [DONE]\n\n"

_ids = random.Random()


@dataclass(frozen=True, slots=True)
class ResponseShape:
    """How the answer goes out: streamed or whole, with usage chunks or not."""

    stream: bool
    include_usage: bool
    continuous: bool


def response_shape(body: dict[str, Any]) -> ResponseShape:
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
    return ResponseShape(stream, include_usage, continuous)


#: vLLM's ``ChatCompletionRequest.check_generation_prompt`` refusal.
GENERATION_PROMPT_CONFLICT = (
    "Cannot set both `continue_final_message` and `add_generation_prompt` to True."
)


def check_generation_prompt(body: dict[str, Any]) -> None:
    """vLLM's ``check_generation_prompt`` validator: both flags true is a 400. It reads the
    raw body (truthy values), so ``continue_final_message`` alone passes here and the
    template refuses it (``add_generation_prompt`` defaults to true: a ``BadRequestError``)."""
    if body.get("continue_final_message") and body.get("add_generation_prompt"):
        raise model_value_error(GENERATION_PROMPT_CONFLICT, body)


class _ErrorRepr:
    """An exception as ``repr`` shows it inside pydantic's error dict (``ctx.error``)."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return f"VLLMValidationError({self.text!r})"


def model_value_error(text: str, body: dict[str, Any]) -> ApiError:
    """A ``VLLMValidationError`` without ``parameter`` raised by one of vLLM's
    ``mode="before"`` model validators: pydantic makes it a ``value_error`` located at the
    whole body, which vLLM's validation handler formats as :func:`validation_error` does,
    ``ctx`` included, with the location (``body``) as ``param``."""
    detail = {
        "type": "value_error",
        "loc": "body",
        "msg": f"Value error, {text}",
        "input": f"<dict of {len(body)} items>",
        "ctx": {"error": _ErrorRepr(text)},
    }
    return ApiError(400, f"1 validation error:\n  {detail}", "Bad Request", "body")


def cache_salt_field(body: dict[str, Any]) -> str | None:
    """vLLM's ``cache_salt``: 1 to 1024 characters, or absent."""
    value = body.get("cache_salt")
    if value is None:
        return None
    if isinstance(value, str) and 0 < len(value) <= 1024:
        return value
    raise validation_error(
        "string_type", "body.cache_salt", "Input should be a valid string", value
    )


def kv_transfer_params_field(body: dict[str, Any]) -> dict[str, Any] | None:
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


def response_id(scope: Scope, body: dict[str, Any], prefix: str) -> str:
    """The answer's ``id``: the client's ``X-Request-Id`` (or body ``request_id``) after
    ``prefix``, else a random one."""
    headers: list[tuple[bytes, bytes]] = scope["headers"]
    for key, value in headers:
        if key == b"x-request-id":
            return prefix + value.decode("latin-1")
    given = body.get("request_id")
    if isinstance(given, str) and given:
        return prefix + given
    return f"{prefix}{_ids.getrandbits(64):016x}"


def model_card(
    name: str, root: str, parent: str | None, max_model_len: int | None, created: int
) -> dict[str, Any]:
    """One entry of ``/v1/models``: a served name, or a LoRA adapter under its base model."""
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


class CompletionFormatter:
    """Pre-rendered pieces of one chat or completions response's JSON; chunks are assembled
    as bytes."""

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
