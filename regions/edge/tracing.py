"""OpenTelemetry spans of the edge's requests, exported over OTLP/HTTP (``--otlp-endpoint``).

Imported only when tracing is on (``app.Edge``): off, nothing here runs, ``RequestContext.trace``
stays None and each stage pays one ``is not None`` check. On, a request is one trace:

``edge.request`` (arrival to the last byte sent; the route header's facts, tenant, status)
├── ``edge.admit``      authentication, body, admission rules
├── ``edge.schedule``   one placement decision (per role, per retry), with its score terms
│   └── ``edge.queue``  the wait at the gateway for a slot, when there was one
├── ``edge.upstream``   one try on an instance (``edge.pd.prefill`` / ``edge.pd.decode`` for
│                       the legs of a disaggregated request, ``edge.spill`` to another region)

Spans are made with explicit start and end times from the stages' own clocks, never held in
context variables, and handed to a batch processor: export runs in its own thread and a full
queue drops spans rather than slowing requests. Every upstream hop gets a ``traceparent``
naming its own span, so an engine's spans hang under it. Never a key or prompt text in a span.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from opentelemetry import trace as otel
from opentelemetry.context import Context
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Span, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from regions.edge.config import TracingConfig
from regions.edge.http.endpoints import Endpoint
from regions.edge.http.server import Message, Receive, Scope, Send
from regions.edge.policy.scheduler import Decision
from regions.edge.stages.context import AdmitStage, RequestContext

_ROUTE = b"x-fedinfer-route"
#: The route header's parts that become span attributes (``fedinfer.route.<part>``).
_ROUTE_PARTS = frozenset(
    (
        "region",
        "instance",
        "reason",
        "policy_reason",
        "runner_up",
        "retries",
        "mode",
        "prefill",
        "prefill_failed",
        "decode",
        "kv",
        "remote_from",
        "spill",
    )
)
_propagator = TraceContextTextMapPropagator()


def _traceparent(span: otel.Span) -> str:
    c = span.get_span_context()
    return f"00-{c.trace_id:032x}-{c.span_id:016x}-{int(c.trace_flags):02x}"


def route_attributes(route: str) -> dict[str, Any]:
    """The ``x-fedinfer-route`` facts as span attributes, with the cached tokens the scheduler
    predicted for the winner (the ``cached:`` score term) as a number."""
    attributes: dict[str, Any] = {"fedinfer.route": route}
    for part in route.split(";"):
        key, sep, value = part.partition("=")
        if not sep:
            continue
        if key in _ROUTE_PARTS:
            attributes[f"fedinfer.route.{key}"] = value
        elif key == "score":
            for term in value.split(","):
                name, _, number = term.partition(":")
                if name == "cached" and number.isdigit():
                    attributes["fedinfer.cached_tokens_predicted"] = int(number)
    return attributes


class EdgeTracer:
    """The edge's tracer: a provider of its own (several edges may share a process), an OTLP
    exporter behind a bounded batch queue."""

    def __init__(self, cfg: TracingConfig, region: str, edge_name: str | None) -> None:
        resource = {"service.name": cfg.service_name, "fedinfer.region": region}
        if edge_name:
            resource["service.instance.id"] = edge_name
        self.provider = TracerProvider(
            resource=Resource.create(resource),
            sampler=ParentBased(TraceIdRatioBased(cfg.sample_ratio)),
        )
        exporter = OTLPSpanExporter(endpoint=cfg.endpoint, timeout=cfg.export_timeout_s)
        self.provider.add_span_processor(BatchSpanProcessor(exporter, max_queue_size=cfg.max_queue))
        self.tracer = self.provider.get_tracer("fedinfer.edge")

    def start(self, incoming: str | None, arrived: float, path: str, send: Send) -> RequestTrace:
        """A request's trace from its arrival (``perf_counter`` seconds), a child of the
        caller's ``traceparent`` when it sent a valid one."""
        parent = _propagator.extract({"traceparent": incoming}) if incoming else None
        return RequestTrace(self.tracer, parent, arrived, path, send)

    def admitting(self, admit: AdmitStage) -> AdmitStage:
        """``admit`` (the admit stage) with each request's trace started before it: every
        answer, a refusal included, then passes :meth:`RequestTrace.send`."""

        async def traced(
            scope: Scope, receive: Receive, send: Send, endpoint: Endpoint
        ) -> RequestContext | None:
            arrived = time.perf_counter()
            incoming = next((v for k, v in scope["headers"] if k == b"traceparent"), None)
            spans = self.start(
                incoming.decode("latin-1") if incoming else None, arrived, scope["path"], send
            )
            ctx = await admit(scope, receive, spans.send, endpoint)
            if ctx is None:  # refused (the status passed spans.send), or the client left
                spans.close(0, {"fedinfer.client_gone": not spans.status})
                return None
            spans.admitted(arrived, ctx)
            ctx.traceparent = spans.traceparent
            ctx.trace = spans
            return ctx

        return traced

    def shutdown(self) -> None:
        """Export what is buffered and stop the export thread."""
        self.provider.shutdown()


class RequestTrace:
    """One request's spans. :meth:`send` stands in for the ASGI ``send``: it reads the status
    and the route header of the answer, whatever stage wrote it, and the last byte's time."""

    __slots__ = ("_inner", "_offset_ns", "_parent", "last_byte_ns", "root", "status", "tracer")

    def __init__(
        self, tracer: otel.Tracer, parent: Context | None, arrived: float, path: str, send: Send
    ) -> None:
        self.tracer = tracer
        # perf_counter seconds -> epoch nanoseconds, for spans timed by the stages' clocks.
        self._offset_ns = time.time_ns() - time.perf_counter_ns()
        self.root = tracer.start_span(
            "edge.request",
            context=parent,
            kind=SpanKind.SERVER,
            start_time=self.ns(arrived),
            attributes={"http.request.method": "POST", "url.path": path},
        )
        self._parent = otel.set_span_in_context(self.root)
        self._inner = send
        self.status = 0
        self.last_byte_ns = 0

    def ns(self, perf: float) -> int:
        return self._offset_ns + int(perf * 1e9)

    @property
    def traceparent(self) -> str:
        """The request's span, as the ``traceparent`` its answer carries."""
        return _traceparent(self.root)

    async def send(self, message: Message) -> None:
        kind = message["type"]
        if kind == "http.response.start":
            self.status = message["status"]
            self.root.set_attribute("http.response.status_code", self.status)
            for name, value in message.get("headers", ()):
                if name == _ROUTE:
                    self.root.set_attributes(route_attributes(value.decode("latin-1")))
            await self._inner(message)
            return
        await self._inner(message)
        if kind == "http.response.body" and not message.get("more_body", False):
            self.last_byte_ns = time.time_ns()

    def admitted(self, arrived: float, ctx: RequestContext) -> None:
        now = time.time_ns()
        self.tracer.start_span("edge.admit", context=self._parent, start_time=self.ns(arrived)).end(
            end_time=now
        )
        req = ctx.req
        attributes: dict[str, Any] = {
            "gen_ai.request.model": req.model,
            "fedinfer.stream": req.stream,
        }
        if ctx.tenant is not None:
            attributes["fedinfer.tenant"] = ctx.tenant.slug
        self.root.set_attributes(attributes)

    def scheduled(self, started: float, role: str, decision: Decision, waited_s: float) -> None:
        """One placement decision (``perf_counter`` start) and the gateway wait within it."""
        span = self.tracer.start_span(
            "edge.schedule", context=self._parent, start_time=self.ns(started)
        )
        attributes: dict[str, Any] = {
            "fedinfer.role": role,
            "fedinfer.reason": decision.reason,
            "fedinfer.queue_ms": waited_s * 1000.0,
        }
        winner = decision.winner
        if winner is not None:
            attributes.update(
                {
                    "fedinfer.instance": winner.instance,
                    "fedinfer.cached_tokens_predicted": winner.cached_tokens,
                    "fedinfer.ttft_predicted_ms": winner.ttft_s * 1000.0,
                }
            )
        if decision.runner_up is not None:
            attributes["fedinfer.runner_up"] = decision.runner_up.instance
        span.set_attributes(attributes)
        if waited_s > 0:
            self.tracer.start_span(
                "edge.queue", context=otel.set_span_in_context(span), start_time=self.ns(started)
            ).end(end_time=self.ns(started + waited_s))
        span.end()

    @contextmanager
    def leg(self, name: str, target: str) -> Iterator[Leg]:
        """One upstream hop to ``target`` (an instance, or a region for ``edge.spill``); an
        exception out of it marks the span as failed."""
        span = self.tracer.start_span(
            name,
            context=self._parent,
            kind=SpanKind.CLIENT,
            attributes={"fedinfer.target": target},
        )
        leg = Leg(span)
        try:
            yield leg
        except BaseException as exc:
            span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
            raise
        finally:
            # A leg that relayed the answer ends with its last byte, as the request does.
            span.end(end_time=self.last_byte_ns or None)

    def close(self, status: int, attributes: dict[str, Any]) -> None:
        """The request is over: end its span at the last byte sent (now, when none was)."""
        root = self.root
        if status and not self.status:
            root.set_attribute("http.response.status_code", status)
        root.set_attributes(attributes)
        if (self.status or status) >= 500:
            root.set_status(Status(StatusCode.ERROR))
        root.end(end_time=self.last_byte_ns or None)


class Leg:
    """An upstream hop's span and the ``traceparent`` that hop sends."""

    __slots__ = ("span", "traceparent")

    def __init__(self, span: Span | otel.Span) -> None:
        self.span = span
        self.traceparent = _traceparent(span)
