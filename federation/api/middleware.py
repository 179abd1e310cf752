"""Refuse oversized request bodies with a clear 413 before anything reads them.

Two layers, one limit (``DATA_UPLOAD_MAX_MEMORY_SIZE``, ``FEDINFER_MAX_BODY_BYTES``):

* :class:`BodyLimitASGIMiddleware` wraps the ASGI application ``fedinfer serve`` runs. Django's
  ASGI handler reads a whole body (into a spooled temporary file) before any Django middleware
  runs, so the limit has to act in front of it: a declared ``Content-Length`` over the limit is
  refused without reading a byte, and a body without one (chunked) is counted as it streams in
  and refused as soon as it goes over.
* :class:`RequestBodyLimitMiddleware` is the Django middleware for the other ways in (WSGI,
  the test client), where the body is still unread when middleware runs.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import orjson
from django.conf import settings
from django.http import HttpRequest, HttpResponse, JsonResponse

Scope = dict[str, Any]
Message = Mapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


def _too_large(detail: str) -> dict[str, str]:
    return {"detail": detail, "code": "payload_too_large"}


class BodyLimitASGIMiddleware:
    """Answer 413 to a request whose body exceeds ``limit`` bytes, before the app reads it.

    After the 413 the connection is closed (``Connection: close``), but only once the rest of
    the body has been read and dropped for up to ``linger_s`` seconds: closing a socket that
    still has unread data sends a reset, which can make a client lose the 413 it was sent.
    Nothing of the refused body is kept: the server reads it in its small buffer, and drops it.
    """

    def __init__(self, app: ASGIApp, *, limit: int | None, linger_s: float = 2.0) -> None:
        self.app = app
        self.limit = limit
        self.linger_s = linger_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        limit = self.limit
        if scope["type"] != "http" or limit is None:
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        declared = headers.get(b"content-length", b"").strip()
        if declared.isdigit() and int(declared) > limit:
            detail = f"Request body of {int(declared)} bytes exceeds the limit of {limit} bytes."
            await self._refuse(scope, receive, send, detail)
            return

        received = 0
        refused = False
        started = False

        async def counting_receive() -> Message:
            nonlocal received, refused
            if refused:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    # The app sees a client that went away (Django stops reading and answers
                    # nothing); the 413 is ours, unless the app had already started answering.
                    refused = True
                    if not started:
                        detail = f"Request body exceeds the limit of {limit} bytes."
                        await self._refuse(scope, receive, send, detail)
                    return {"type": "http.disconnect"}
            return message

        async def guarded_send(message: Message) -> None:
            nonlocal started
            if refused:
                return  # the request was answered (413) or cut off: the app says nothing more
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        await self.app(scope, counting_receive, guarded_send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send, detail: str) -> None:
        body = orjson.dumps(_too_large(detail))
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"connection", b"close"),
                ],
            }
        )
        # The whole response is out (Content-Length says where it ends); the final, empty
        # message that lets the server close the connection waits for the lingering read.
        await send({"type": "http.response.body", "body": body, "more_body": True})
        await self._linger(scope, receive)
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _linger(self, scope: Scope, receive: Receive) -> None:
        headers = dict(scope.get("headers") or [])
        if headers.get(b"expect", b"").lower() == b"100-continue":
            return  # reading would invite the body we refuse (the server sends "100 Continue")
        try:
            async with asyncio.timeout(self.linger_s):
                while True:
                    message = await receive()
                    if message["type"] != "http.request" or not message.get("more_body"):
                        return
        except TimeoutError:
            return


class RequestBodyLimitMiddleware:
    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        limit = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
        try:
            length = int(request.META.get("CONTENT_LENGTH") or 0)
        except ValueError:
            return JsonResponse({"detail": "Content-Length is not a number."}, status=400)
        if limit is not None and length > limit:
            return JsonResponse(
                _too_large(f"Request body of {length} bytes exceeds the limit of {limit} bytes."),
                status=413,
            )
        return self.get_response(request)
