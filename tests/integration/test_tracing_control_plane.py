"""The control plane's OpenTelemetry spans, from real processes: ``fedinfer serve`` and
``fedinfer worker`` with ``FEDINFER_OTLP_ENDPOINT`` export over OTLP/HTTP to a receiver in the
test (protobuf decoded), on this run's PostgreSQL and Redis."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import httpx
import pytest
from django.conf import settings as django_settings

from federation.routing.services import PUBLISH_TASK
from regions.supervisor import Supervisor
from tests.integration.control_plane_support import (
    FEDINFER,
    own_redis,
    serve,
    subprocess_env,
)
from tests.integration.test_tracing_support import (
    CONSUMER,
    FAST_EXPORT,
    SERVER,
    otlp_receiver,
)
from workers.celery import app as celery_app

CALLER_SPAN = "00f067aa0ba902b7"


def traceparent(trace_id: str) -> dict[str, str]:
    return {"traceparent": f"00-{trace_id}-{CALLER_SPAN}-01"}


@pytest.mark.django_db(transaction=True)
def test_an_api_request_is_one_server_span_and_scrapes_are_not_traced(
    procs: Supervisor, settings: Any
) -> None:
    with otlp_receiver() as rx, own_redis(settings, settings.REDIS_URL):
        env = subprocess_env(settings.REDIS_URL, FEDINFER_OTLP_ENDPOINT=rx.url, **FAST_EXPORT)
        url, _ = serve(procs, env)
        scrape, api = "6" * 32, "5" * 32
        assert httpx.get(url + "/metrics", headers=traceparent(scrape), timeout=10).is_success
        resp = httpx.get(url + "/api/v1/regions/", headers=traceparent(api), timeout=10)
        assert resp.status_code in (401, 403)  # no credentials: refused, and still traced
        spans = rx.wait_for(
            lambda ss: any(s.trace_id == api and s.kind == SERVER for s in ss),
            "the API request's span",
        )
    (span,) = [s for s in spans if s.trace_id == api]
    assert span.service == "fedinfer-control-plane"
    assert span.parent_id == CALLER_SPAN  # the caller's trace continues
    # By URL pattern (the DRF router's regular expression), never by raw path.
    assert span.attributes["http.route"] == "api/v1/regions/$"
    assert span.attributes["http.status_code"] == resp.status_code
    assert span.name == "GET api/v1/regions/$"
    # The scrape ended first, so it would have been exported no later than the API request.
    assert not [s for s in spans if s.trace_id == scrape]


@pytest.mark.django_db(transaction=True)
def test_a_task_run_by_a_real_worker_is_a_span_of_the_trace_that_queued_it(
    procs: Supervisor, settings: Any
) -> None:
    with otlp_receiver() as rx, own_redis(settings, settings.REDIS_URL):
        env = subprocess_env(settings.REDIS_URL, FEDINFER_OTLP_ENDPOINT=rx.url, **FAST_EXPORT)
        # The default prefork pool: the task runs in a process forked after tracing was set up.
        argv = [FEDINFER, "worker", "--no-beat", "--concurrency", "1"]
        worker = procs.start("worker", [*argv, "--without-gossip", "--without-mingle"], env=env)
        trace_id = "7" * 32
        # As an instrumented publisher sends it: the trace context in the message's headers.
        celery_app.send_task(PUBLISH_TASK, headers=traceparent(trace_id))
        spans = rx.wait_for(
            lambda ss: any(s.trace_id == trace_id and s.kind == CONSUMER for s in ss),
            "the task's span",
            timeout=60,
        )
        assert worker.poll() is None
    (run,) = [s for s in spans if s.trace_id == trace_id]
    assert run.service == "fedinfer-worker"
    assert run.parent_id == CALLER_SPAN
    assert run.name == f"run/{PUBLISH_TASK}"
    assert run.attributes["celery.task_name"] == PUBLISH_TASK
    assert run.attributes["celery.state"] == "SUCCESS"


def test_an_endpoint_without_the_extra_stops_the_boot_with_the_fix() -> None:
    """As if ``fedinfer[tracing]`` were not installed: opentelemetry cannot be imported."""
    code = "import sys; sys.modules['opentelemetry'] = None\nimport federation.asgi\n"
    env = {
        **subprocess_env(django_settings.REDIS_URL),
        "FEDINFER_OTLP_ENDPOINT": "http://127.0.0.1:9/v1/traces",
    }
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        check=False,
    )
    assert out.returncode != 0
    assert "FEDINFER_OTLP_ENDPOINT is set but the tracing extra is not installed" in out.stderr
    assert "pip install 'fedinfer[tracing]'" in out.stderr
