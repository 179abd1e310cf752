"""OpenAI-style error bodies: ``{"error": {"message", "type", "param", "code"}}``.

Clients written against the OpenAI SDK map these to typed exceptions, so every refusal of the
edge uses this shape (and a ``Retry-After`` where waiting helps).
"""

from __future__ import annotations

from dataclasses import dataclass

import orjson

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    502: "upstream_error",
    503: "service_unavailable",
    504: "timeout_error",
}


@dataclass(frozen=True, slots=True)
class EdgeError(Exception):
    """A refusal with its HTTP status; ``code`` is a short machine-readable reason."""

    status: int
    message: str
    code: str
    param: str | None = None
    retry_after: int | None = None

    def body(self) -> bytes:
        return error_body(self.message, self.status, self.code, self.param)


def error_body(message: str, status: int, code: str, param: str | None = None) -> bytes:
    return orjson.dumps(
        {
            "error": {
                "message": message,
                "type": _TYPES.get(status, "api_error"),
                "param": param,
                "code": code,
            }
        }
    )


def sse_error_event(message: str, code: str) -> bytes:
    """The last event of a stream that was cut after its first byte (no retry possible)."""
    return b"data: " + error_body(message, 502, code) + b"\n\n"


def responses_error_event(message: str, code: str, sequence_number: int | None) -> bytes:
    """The same for a Responses API stream: its ``error`` event (``sequence_number``: the
    events relayed before it; None when the edge did not count them)."""
    doc = {
        "code": code,
        "message": message,
        "param": None,
        "sequence_number": sequence_number,
        "type": "error",
    }
    return b"event: error\ndata: " + orjson.dumps(doc) + b"\n\n"


class UpstreamFailure(Exception):
    """The chosen instance failed before the first byte reached the client.

    ``connect``: it never (fully) answered — refused, reset, timed out — as opposed to an
    answer with a 5xx status; health counts the two differently.

    ``retry``: another instance may be tried. Only when the engine cannot be running the
    request: the connection failed before the request was written, the engine dropped the
    connection itself (crashed, or gave the request up), or it answered with a 5xx status.
    After a read timeout (or a malformed or oversized answer) the engine may still be
    generating it, so it is never sent to a second one.
    """

    def __init__(self, reason: str, connect: bool, retry: bool = True) -> None:
        super().__init__(reason)
        self.reason = reason
        self.connect = connect
        self.retry = retry
