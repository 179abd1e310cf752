"""The HTTP pieces every route of the simulator shares: vLLM's error shapes (FastAPI and
pydantic validation failures, ``{"error": {...}}``), the JSON body, plain responses, and the
log filter for connections the simulator cuts on purpose."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import orjson

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

JSON_HEADERS = [(b"content-type", b"application/json")]
SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8")]
CUT_MESSAGE = "ASGI callable returned without completing response."


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


class ApiError(Exception):
    """An error response in vLLM's shape."""

    def __init__(self, status: int, message: str, err_type: str, param: str | None = None):
        super().__init__(message)
        self.status = status
        self.body = {
            "error": {"message": message, "type": err_type, "param": param, "code": status}
        }


def validation_error(kind: str, loc: str, msg: str, value: Any) -> ApiError:
    """FastAPI/pydantic request validation failure, formatted as vLLM's handler does."""
    if isinstance(value, list | tuple | dict | set):
        shown: Any = f"<{type(value).__name__} of {len(value)} items>"
    else:
        shown = value
    detail = {"type": kind, "loc": loc, "msg": msg, "input": shown}
    return ApiError(400, f"1 validation error:\n  {detail}", "Bad Request", loc)


def bad_request(message: str, param: str | None = None) -> ApiError:
    if param is not None:
        message = f"{message} (parameter={param})"
    return ApiError(400, message, "BadRequestError", param)


def int_field(body: dict[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise validation_error("int_type", f"body.{name}", "Input should be a valid integer", value)
    return value


def bool_field(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise validation_error(
            "bool_type", f"body.{name}", "Input should be a valid boolean", value
        )
    return value


class Disconnected(ApiError):
    def __init__(self) -> None:
        super().__init__(499, "client disconnected", "ClientDisconnected")


async def json_body(scope: Scope, receive: Receive) -> dict[str, Any]:
    """The request's JSON object, or the 400 vLLM gives for a wrong content type or bad JSON."""
    content_type = b""
    for key, value in scope["headers"]:
        if key == b"content-type":
            content_type = value
            break
    if content_type.split(b";", 1)[0].strip().lower() != b"application/json":
        raise ApiError(
            400,
            "1 validation error:\n  Unsupported Media Type: Only 'application/json' is allowed",
            "Bad Request",
        )
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise Disconnected
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            break
    raw = chunks[0] if len(chunks) == 1 else b"".join(chunks)
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        detail = {
            "type": "json_invalid",
            "loc": "body.0",
            "msg": "JSON decode error",
            "input": {},
            "ctx": {"error": exc.msg},
        }
        raise ApiError(400, f"1 validation error:\n  {detail}", "Bad Request", "body.0") from None
    if not isinstance(body, dict):
        raise validation_error(
            "model_attributes_type",
            "body",
            "Input should be a valid dictionary or object to extract fields from",
            body,
        )
    return body


async def until_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def send_json(send: Send, status: int, obj: Any) -> None:
    if status == 499:
        return  # the client is gone; nobody to answer
    body = orjson.dumps(obj)
    headers = [*JSON_HEADERS, (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def send_raw_json(send: Send, body: bytes) -> None:
    headers = [*JSON_HEADERS, (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def send_text(send: Send, status: int, text: str) -> None:
    body = text.encode()
    headers = [(b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
