"""vLLM's OpenAI-compatible HTTP API over one :class:`SimEngine`, as a bare ASGI app.

Bare ASGI rather than a framework: the zero-latency mode exists to measure a router's overhead,
so the simulator's own per-request cost must be small. This module routes, and answers the
small endpoints (health, metrics, models, LoRA adapters, the fault admin); generation is in
``generation``, pooling and the tokenizer in ``pooling``. Errors use vLLM's
``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST

from regions.engines.simulator.engine import VLLM_VERSION, ModelNotFound, SimEngine
from regions.engines.simulator.generation import GenerationApi
from regions.engines.simulator.http import (
    CUT_FILTER,
    ApiError,
    Receive,
    Scope,
    Send,
    bad_request,
    json_body,
    send_json,
    send_text,
    validation_error,
)
from regions.engines.simulator.kv_transfer import READ_PATH
from regions.engines.simulator.openai_protocol import model_card
from regions.engines.simulator.pooling import PoolingApi


class EngineApp:
    """ASGI app of one engine; ``on_kill`` stops its listener."""

    def __init__(self, engine: SimEngine, on_kill: Callable[[], None] | None = None):
        self.engine = engine
        self.on_kill = on_kill
        self.routes: dict[str, tuple[str, Callable[[Scope, Receive, Send], Awaitable[None]]]] = {
            "/v1/models": ("GET", self.models),
            "/health": ("GET", self.health),
            "/metrics": ("GET", self.metrics),
            "/version": ("GET", self.version),
            "/v1/load_lora_adapter": ("POST", self.load_lora),
            "/v1/unload_lora_adapter": ("POST", self.unload_lora),
            "/reset_prefix_cache": ("POST", self.reset_prefix_cache),
            "/admin/faults": ("*", self.admin_faults),
            READ_PATH: ("POST", self.kv_read),
        }
        for api in (GenerationApi(engine, self._model), PoolingApi(engine, self._model)):
            for path, handler in api.routes().items():
                self.routes[path] = ("POST", handler)

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
            model_card(name, engine.config.model, None, engine.max_model_len, created)
            for name in engine.served_model_names
        ]
        cards += [
            model_card(name, path, engine.served_model_names[0], None, created)
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

    def _model(self, body: dict[str, Any]) -> tuple[str, str | None]:
        """The name the client used (echoed in answers) and the adapter it resolves to; 404
        for a name this engine does not serve."""
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
