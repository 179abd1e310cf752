"""vLLM's pooling and tokenizer routes over one :class:`SimEngine`, in vLLM 0.32's shapes.

``/v1/embeddings`` (and Cohere's ``/v2/embed``), ``/pooling``, ``/classify``, ``/score`` and
``/v1/score``, ``/rerank``, ``/v1/rerank`` and ``/v2/rerank`` (``vllm/entrypoints/pooling/``),
``/tokenize`` and ``/detokenize`` (``vllm/entrypoints/serve/tokenize/``). Bodies are those
protocol classes dumped with every field, as vLLM's routers do. A pooling input costs what a
pooling model's forward pass costs: it runs through the engine as a prefill (one step past it),
so it takes a slot, shows in ``/metrics`` and waits behind other work. Its vector is a
deterministic function of its tokens (same input, same embedding). Every engine of the
simulator answers these routes, whatever its model: vLLM serves them only with
``--runner pooling`` (the tokenizer's routes always).
"""

from __future__ import annotations

import asyncio
import base64
import math
import random
import time
from array import array
from collections.abc import Callable
from typing import Any

from regions.engines.simulator.engine import RequestStream, SimEngine
from regions.engines.simulator.http import (
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
    until_disconnect,
    validation_error,
)
from regions.engines.simulator.scheduler import Status
from regions.engines.simulator.tokenizer import tokens_digest

#: Size of an embedding when the request does not ask for ``dimensions``.
EMBED_DIMENSIONS = 64
#: Labels of the simulated classifier.
LABELS = ("LABEL_0", "LABEL_1")

#: Where score requests keep their two sides, under vLLM's several names.
_SCORE_FIRST = ("text_1", "queries", "data_1")
_SCORE_SECOND = ("text_2", "documents", "items", "data_2")

ModelOf = Callable[[dict[str, Any]], tuple[str, str | None]]
_ids = random.Random()


def _uid() -> str:
    return f"{_ids.getrandbits(128):032x}"


def _vector(ids: list[int], size: int) -> list[float]:
    """A unit vector determined by the tokens."""
    rng = random.Random(tokens_digest(ids))
    raw = [rng.gauss(0.0, 1.0) for _ in range(size)]
    norm = math.sqrt(sum(x * x for x in raw)) or 1.0
    return [x / norm for x in raw]


def _relevance(first: list[int], second: list[int]) -> float:
    """A score in (0, 1) determined by the pair."""
    return random.Random(tokens_digest([*first, 0, *second])).random()


def _usage(prompt: int) -> dict[str, Any]:
    """vLLM's ``UsageInfo`` of a pooling answer: prompt only."""
    return {
        "prompt_tokens": prompt,
        "total_tokens": prompt,
        "completion_tokens": 0,
        "prompt_tokens_details": None,
        "completion_tokens_details": None,
    }


class PoolingApi:
    """The routes; ``model_of`` resolves a body's ``model`` as the engine app does (404)."""

    def __init__(self, engine: SimEngine, model_of: ModelOf) -> None:
        self.engine = engine
        self.model_of = model_of

    def routes(self) -> dict[str, Callable[[Scope, Receive, Send], Any]]:
        return {
            "/v1/embeddings": self.embeddings,
            "/v2/embed": self.cohere_embed,
            "/pooling": self.pooling,
            "/classify": self.classify,
            "/score": self.score,
            "/v1/score": self.score,
            "/rerank": self.rerank,
            "/v1/rerank": self.rerank,
            "/v2/rerank": self.rerank,
            "/tokenize": self.tokenize,
            "/detokenize": self.detokenize,
        }

    # -- tokenizer -----------------------------------------------------------------------

    async def tokenize(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = await json_body(scope, receive)
        self.model_of(body)
        tokenizer = self.engine.tokenizer
        ids = self._encode_one(body, "prompt")
        strs = bool_field(body, "return_token_strs", False)
        await send_json(
            send,
            200,
            {
                "count": len(ids),
                "max_model_len": self.engine.max_model_len,
                "tokens": ids,
                "token_strs": [tokenizer.piece(t) or "" for t in ids] if strs else None,
            },
        )

    async def detokenize(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = await json_body(scope, receive)
        self.model_of(body)
        ids = body.get("tokens")
        if not isinstance(ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids
        ):
            raise validation_error(
                "list_type", "body.tokens", "Input should be a list of token ids", ids
            )
        try:
            text = self.engine.tokenizer.decode(ids)
        except ValueError as exc:
            raise bad_request(str(exc), "tokens") from None
        await send_json(send, 200, {"prompt": text})

    # -- pooling -------------------------------------------------------------------------

    async def embeddings(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = await json_body(scope, receive)
        model, _ = self.model_of(body)
        prompts = self._inputs(body)
        size = int_field(body, "dimensions") or EMBED_DIMENSIONS
        encoding = body.get("encoding_format", "float")
        if encoding not in ("float", "base64"):
            raise bad_request(f"encoding_format {encoding!r} is not supported", "encoding_format")
        await self._run(prompts, body, receive)
        data = []
        for i, ids in enumerate(prompts):
            vector = _vector(ids, size)
            shown: Any = vector
            if encoding == "base64":
                shown = base64.b64encode(array("f", vector).tobytes()).decode()
            data.append({"index": i, "object": "embedding", "embedding": shown})
        await send_json(
            send,
            200,
            {
                "id": f"embd-{_uid()}",
                "object": "list",
                "created": int(time.time()),
                "model": model,
                "data": data,
                "usage": _usage(sum(len(p) for p in prompts)),
            },
        )

    async def cohere_embed(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = await json_body(scope, receive)
        self.model_of(body)
        texts = body.get("texts")
        if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
            raise bad_request("the simulator embeds 'texts' (a list of strings)", "texts")
        prompts = [self._encode_text(t) for t in texts]
        await self._run(prompts, body, receive)
        size = int_field(body, "output_dimension") or EMBED_DIMENSIONS
        await send_json(
            send,
            200,
            {
                "id": f"embd-{_uid()}",
                "embeddings": {
                    "float": [_vector(ids, size) for ids in prompts],
                    "binary": None,
                    "ubinary": None,
                    "base64": None,
                },
                "texts": texts,
                "meta": {
                    "api_version": {"version": "2"},
                    "billed_units": {
                        "input_tokens": sum(len(p) for p in prompts),
                        "image_tokens": None,
                    },
                },
                "response_type": "embeddings_by_type",
            },
        )

    async def pooling(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = await json_body(scope, receive)
        model, _ = self.model_of(body)
        prompts = self._inputs(body)
        await self._run(prompts, body, receive)
        data = [
            {"index": i, "object": "pooling", "data": _vector(ids, EMBED_DIMENSIONS)}
            for i, ids in enumerate(prompts)
        ]
        await self._list(send, "pooling", model, data, prompts)

    async def classify(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = await json_body(scope, receive)
        model, _ = self.model_of(body)
        prompts = self._inputs(body)
        await self._run(prompts, body, receive)
        data = []
        for i, ids in enumerate(prompts):
            p = _relevance(ids, [])
            probs = [1.0 - p, p]
            data.append(
                {
                    "index": i,
                    "label": LABELS[probs.index(max(probs))],
                    "probs": probs,
                    "num_classes": len(LABELS),
                }
            )
        await self._list(send, "classify", model, data, prompts)

    async def score(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = await json_body(scope, receive)
        model, _ = self.model_of(body)
        pairs = self._pairs(
            body, ("text_1", "queries", "data_1"), ("text_2", "documents", "items", "data_2")
        )
        prompts = [first + second for first, second, _ in pairs]
        await self._run(prompts, body, receive)
        data = [
            {"index": i, "object": "score", "score": _relevance(first, second)}
            for i, (first, second, _) in enumerate(pairs)
        ]
        await self._list(send, "score", model, data, prompts)

    async def rerank(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = await json_body(scope, receive)
        model, _ = self.model_of(body)
        pairs = self._pairs(body, ("query",), ("documents",))
        prompts = [first + second for first, second, _ in pairs]
        await self._run(prompts, body, receive)
        scores = [_relevance(first, second) for first, second, _ in pairs]
        order = sorted(range(len(pairs)), key=lambda i: -scores[i])
        results = [
            {
                "index": i,
                "document": {"text": pairs[i][2], "multi_modal": None},
                "relevance_score": scores[i],
            }
            for i in order
        ]
        top_n = int_field(body, "top_n") or 0
        if top_n > 0:
            results = results[:top_n]
        tokens = sum(len(p) for p in prompts)
        await send_json(
            send,
            200,
            {
                "id": f"rerank-{_uid()}",
                "model": model,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
                "results": results,
            },
        )

    # -- helpers -------------------------------------------------------------------------

    async def _list(
        self, send: Send, prefix: str, model: str, data: list[Any], prompts: list[list[int]]
    ) -> None:
        await send_json(
            send,
            200,
            {
                "id": f"{prefix}-{_uid()}",
                "object": "list",
                "created": int(time.time()),
                "model": model,
                "data": data,
                "usage": _usage(sum(len(p) for p in prompts)),
            },
        )

    def _encode_text(self, text: str) -> list[int]:
        limit = self.engine.max_model_len
        ids = self.engine.tokenizer.encode(text)
        if len(ids) > limit:
            raise ApiError(
                400,
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{len(ids)} tokens in the input for embedding generation. Please reduce the "
                "length of the input.",
                "BadRequestError",
                "input_tokens",
            )
        return ids

    def _encode_one(self, body: dict[str, Any], name: str) -> list[int]:
        """A ``prompt`` string, or ``messages`` through the chat template."""
        tokenizer = self.engine.tokenizer
        if "messages" in body:
            messages = body["messages"]
            if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
                raise validation_error(
                    "list_type", "body.messages", "Input should be a valid list", messages
                )
            add = bool_field(body, "add_generation_prompt", True)
            try:
                return tokenizer.encode(tokenizer.apply_chat_template(messages, add))
            except ValueError as exc:
                raise bad_request(str(exc)) from None
        value = body.get(name)
        if not isinstance(value, str):
            raise validation_error("missing", f"body.{name}", "Field required", body)
        return tokenizer.encode(value)

    def _inputs(self, body: dict[str, Any]) -> list[list[int]]:
        """``input``: a string, token ids, or a list of either (or ``messages``)."""
        if "messages" in body and "input" not in body:
            return [self._encode_one(body, "input")]
        value = body.get("input")
        if value is None:
            raise validation_error("missing", "body.input", "Field required", body)
        items = value if isinstance(value, list) and value and not _is_ids(value) else [value]
        out = []
        for item in items:
            if isinstance(item, str):
                out.append(self._encode_text(item))
            elif isinstance(item, list) and item and _is_ids(item):
                out.append(list(item))
            else:
                raise bad_request("each input must be a string or a list of token ids", "input")
        return out

    def _pairs(
        self, body: dict[str, Any], firsts: tuple[str, ...], seconds: tuple[str, ...]
    ) -> list[tuple[list[int], list[int], str]]:
        """Score and rerank inputs: (first ids, second ids, second text), one per pair; one
        first input is paired with every second, else they pair one to one."""
        first_name = next((k for k in firsts if k in body), firsts[0])
        second_name = next((k for k in seconds if k in body), seconds[0])
        first, second = body.get(first_name), body.get(second_name)
        for name, value in ((first_name, first), (second_name, second)):
            if isinstance(value, str):
                continue
            if (
                not isinstance(value, list)
                or not value
                or not all(isinstance(v, str) for v in value)
            ):
                raise validation_error("missing", f"body.{name}", "Field required", body)
        ones = [first] if isinstance(first, str) else list(first)  # type: ignore[arg-type]
        twos = [second] if isinstance(second, str) else list(second)  # type: ignore[arg-type]
        if len(ones) == 1:
            ones = ones * len(twos)
        if len(ones) != len(twos):
            raise bad_request("the two inputs must have the same length, or the first one")
        return [
            (self._encode_text(a), self._encode_text(b), b) for a, b in zip(ones, twos, strict=True)
        ]

    async def _run(self, prompts: list[list[int]], body: dict[str, Any], receive: Receive) -> None:
        """Every input through the engine as a prefill, concurrently (as vLLM batches them);
        a client that leaves aborts them (their slots and blocks are freed at once)."""
        salt = body.get("cache_salt")
        cache_salt = salt if isinstance(salt, str) and salt else None
        engine = self.engine
        requests = [engine.new_request(ids, 1, cache_salt=cache_salt) for ids in prompts]
        handles = [engine.submit(request, texts) for request, texts in requests]
        work = asyncio.ensure_future(asyncio.gather(*(_finished(h) for h in handles)))
        gone = asyncio.ensure_future(until_disconnect(receive))
        try:
            await asyncio.wait((work, gone), return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if not work.done():
            for handle in handles:
                engine.abort(handle.request.request_id)
            await work
            raise Disconnected
        if any(h.cut for h in handles):
            raise ApiError(
                500,
                "EngineCore encountered an issue. See stack trace (above) for the root cause.",
                "InternalServerError",
            )


async def _finished(handle: RequestStream) -> None:
    """Until the engine finished the request (or was killed, or aborted it)."""
    request = handle.request
    while request.status is not Status.FINISHED and not handle.cut:
        await handle.wait()


def _is_ids(value: list[Any]) -> bool:
    return all(isinstance(t, int) and not isinstance(t, bool) for t in value)
