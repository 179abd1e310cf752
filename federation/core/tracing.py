"""OpenTelemetry spans of the control plane: one per API request (the web) and one per Celery
task published and run (the web and the worker), exported over OTLP/HTTP.

Off unless ``FEDINFER_OTLP_ENDPOINT`` is set; then the official instrumentations
(``opentelemetry-instrumentation-django`` and ``-celery``, the ``tracing`` extra) are switched
on before Django builds its middleware (``federation.asgi``) or as the worker boots
(``workers.celery``). Off, nothing here imports OpenTelemetry. Set but the extra missing, the
boot stops with the command that fixes it. Those instrumentations read the process's global
tracer provider, so each process (the web, the worker, its pool processes) sets its own once.
A task published under a request carries the request's trace, so its run in the worker hangs
under the API call that queued it.
"""

from __future__ import annotations

import os

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured

_MISSING = (
    "FEDINFER_OTLP_ENDPOINT is set but the tracing extra is not installed ({error}): "
    "pip install 'fedinfer[tracing]'"
)


#: URLs (regular expressions, comma-separated) whose requests get no span.
_UNTRACED = r"/metrics(\?|$),/healthz(\?|$),/readyz(\?|$)"


def tracing_enabled() -> bool:
    return bool(settings.FEDINFER_OTLP_ENDPOINT)


def sample_ratio() -> float:
    """``FEDINFER_TRACE_SAMPLE_RATIO``: the share of new traces recorded (0..1)."""
    raw = settings.FEDINFER_TRACE_SAMPLE_RATIO
    try:
        ratio = float(raw)
    except ValueError:
        raise ImproperlyConfigured(f"FEDINFER_TRACE_SAMPLE_RATIO={raw!r} is not a number") from None
    if not 0.0 <= ratio <= 1.0:
        raise ImproperlyConfigured(f"FEDINFER_TRACE_SAMPLE_RATIO={raw!r} is not within 0..1")
    return ratio


def _install_provider(default_service: str) -> None:
    """This process's tracer provider: OTLP/HTTP behind a bounded batch queue. Its service name
    is ``OTEL_SERVICE_NAME`` when set, else ``default_service``."""
    try:
        from opentelemetry import trace
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
    except ImportError as exc:
        raise ImproperlyConfigured(_MISSING.format(error=exc)) from exc
    service = os.environ.get("OTEL_SERVICE_NAME") or default_service
    provider = TracerProvider(
        resource=Resource.create({"service.name": service}),
        sampler=ParentBased(TraceIdRatioBased(sample_ratio())),
    )
    provider.add_span_processor(
        BatchSpanProcessor(OTLPSpanExporter(endpoint=settings.FEDINFER_OTLP_ENDPOINT))
    )
    trace.set_tracer_provider(provider)


def _instrument_celery() -> None:
    try:
        from opentelemetry.instrumentation.celery import CeleryInstrumentor
    except ImportError as exc:
        raise ImproperlyConfigured(_MISSING.format(error=exc)) from exc
    CeleryInstrumentor().instrument()


def trace_web() -> bool:
    """Span every request the web serves, and every task it queues; before Django builds its
    middleware. True when tracing is on."""
    if not tracing_enabled():
        return False
    _install_provider("fedinfer-control-plane")
    try:
        import opentelemetry.instrumentation.asgi  # noqa: F401  (Django's spans of ASGI requests)
        from opentelemetry.instrumentation.django import DjangoInstrumentor
    except ImportError as exc:
        raise ImproperlyConfigured(_MISSING.format(error=exc)) from exc
    # /metrics and the probes are scraped every few seconds: spans of them would bury the
    # requests worth reading.
    DjangoInstrumentor().instrument(excluded_urls=_UNTRACED)
    _instrument_celery()
    return True


def trace_worker() -> bool:
    """Span every task the worker runs (its pool processes inherit it) and queues; as the
    worker boots. True when tracing is on."""
    if not tracing_enabled():
        return False
    _install_provider("fedinfer-worker")
    _instrument_celery()
    return True
