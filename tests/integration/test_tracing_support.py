"""A real OTLP/HTTP trace receiver for the tracing tests: a small HTTP server on loopback that
decodes what the processes' OTLP exporters post (``ExportTraceServiceRequest`` protobuf, as
``opentelemetry-proto`` defines it), so the tests check the exporters' real path."""

from __future__ import annotations

import gzip
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

#: OTLP's SpanKind numbers.
SERVER, CLIENT, CONSUMER = 2, 3, 5


@dataclass
class SpanRecord:
    name: str
    service: str
    trace_id: str
    span_id: str
    parent_id: str
    kind: int
    start_ns: int
    end_ns: int
    status: int
    attributes: dict[str, Any] = field(default_factory=dict)


def _value(v: AnyValue) -> Any:
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind is not None else None


class Receiver:
    """The spans every exporter posted to ``url``, in arrival order."""

    def __init__(self) -> None:
        self.spans: list[SpanRecord] = []
        self.lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length", "0")))
                if self.headers.get("content-encoding") == "gzip":
                    body = gzip.decompress(body)
                receiver.take(ExportTraceServiceRequest.FromString(body))
                out = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *args: Any) -> None:
                pass

        return Handler

    def take(self, request: ExportTraceServiceRequest) -> None:
        spans = []
        for rs in request.resource_spans:
            resource = {a.key: _value(a.value) for a in rs.resource.attributes}
            for ss in rs.scope_spans:
                for s in ss.spans:
                    spans.append(
                        SpanRecord(
                            name=s.name,
                            service=str(resource.get("service.name", "")),
                            trace_id=s.trace_id.hex(),
                            span_id=s.span_id.hex(),
                            parent_id=s.parent_span_id.hex(),
                            kind=s.kind,
                            start_ns=s.start_time_unix_nano,
                            end_ns=s.end_time_unix_nano,
                            status=s.status.code,
                            attributes={a.key: _value(a.value) for a in s.attributes},
                        )
                    )
        with self.lock:
            self.spans.extend(spans)

    def wait_for(
        self, check: Callable[[list[SpanRecord]], bool], what: str, timeout: float = 20.0
    ) -> list[SpanRecord]:
        """The spans received once ``check`` holds for them; fails after ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            with self.lock:
                spans = list(self.spans)
            if check(spans):
                return spans
            if time.monotonic() > deadline:
                names = sorted({(s.service, s.name) for s in spans})
                raise AssertionError(f"no {what} within {timeout} s; received {names}")
            time.sleep(0.05)

    def trace(self, trace_id: str, until: str, timeout: float = 20.0) -> list[SpanRecord]:
        """The spans of one trace, once its span named ``until`` has arrived."""
        spans = self.wait_for(
            lambda ss: any(s.trace_id == trace_id and s.name == until for s in ss),
            f"span {until!r} of trace {trace_id}",
            timeout,
        )
        return [s for s in spans if s.trace_id == trace_id]


@contextmanager
def otlp_receiver() -> Iterator[Receiver]:
    receiver = Receiver()
    thread = threading.Thread(target=receiver.server.serve_forever, daemon=True)
    thread.start()
    try:
        yield receiver
    finally:
        receiver.server.shutdown()
        receiver.server.server_close()
        thread.join(timeout=5)


#: Exporters send a batch every 100 ms instead of every 5 s (OpenTelemetry's own variable).
FAST_EXPORT = {"OTEL_BSP_SCHEDULE_DELAY": "100"}
