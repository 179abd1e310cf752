"""The worker's Prometheus metrics: every task's outcome and duration (Celery signals), served
with the control-plane counters this worker updates (table compiles and publishes, LP solves,
rejected usage) on ``FEDINFER_WORKER_METRICS_PORT``.

``fedinfer worker`` runs tasks in pool processes (prefork by default, or in its main process
with ``--pool solo``) and beat in a process of its own, so the samples are kept in
prometheus_client's multiprocess mode: ``fedinfer worker`` points ``PROMETHEUS_MULTIPROC_DIR``
at a fresh directory before anything imports prometheus_client, every process writes its
samples there, and one HTTP server, started in the main process as the worker boots, adds
them up. The families live in a registry of their own, so the web's ``/metrics`` does not
list them.
"""

from __future__ import annotations

import logging
import os
from time import perf_counter
from typing import Any

from celery import signals
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from prometheus_client import CollectorRegistry, Counter, Histogram, multiprocess, start_http_server

log = logging.getLogger("fedinfer.worker.metrics")

#: Where the processes of one ``fedinfer worker`` write their samples (``federation.cli``).
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"

WORKER = CollectorRegistry()
TASKS = Counter(
    "fedinfer_worker_tasks",
    "Celery tasks run, by task name and outcome (success, failure, retry)",
    ["task", "outcome"],
    registry=WORKER,
)
TASK_DURATION = Histogram(
    "fedinfer_worker_task_duration_seconds",
    "Celery task run time, by task name",
    ["task"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300),
    registry=WORKER,
)
#: task id -> perf_counter() when it started, in the process that runs it.
_started: dict[str, float] = {}


@signals.task_prerun.connect
def _task_started(task_id: str | None = None, **_: Any) -> None:
    if task_id is not None:
        _started[task_id] = perf_counter()


@signals.task_postrun.connect
def _task_finished(
    task_id: str | None = None, task: Any = None, state: str | None = None, **_: Any
) -> None:
    started = _started.pop(task_id or "", None)
    name = getattr(task, "name", None) or "unknown"
    TASKS.labels(name, (state or "unknown").lower()).inc()
    if started is not None:
        TASK_DURATION.labels(name).observe(perf_counter() - started)


@signals.worker_process_shutdown.connect
def _pool_process_gone(pid: int | None = None, **_: Any) -> None:
    """A pool process exits: its live gauges go (its counters stay in the sums)."""
    if os.environ.get(MULTIPROC_ENV):
        multiprocess.mark_process_dead(pid or os.getpid())


@signals.worker_init.connect
def serve_metrics(**_: Any) -> None:
    """Start the HTTP server in the worker's main process when a port is configured."""
    port: int = settings.FEDINFER_WORKER_METRICS_PORT
    if not port:
        return
    if not os.environ.get(MULTIPROC_ENV):
        raise ImproperlyConfigured(
            f"FEDINFER_WORKER_METRICS_PORT needs {MULTIPROC_ENV} set before the worker starts, "
            "which `fedinfer worker` does: start the worker with it"
        )
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry)
    address: str = settings.FEDINFER_WORKER_METRICS_ADDR
    start_http_server(port, addr=address, registry=registry)
    log.info("worker metrics on http://%s:%d/metrics", address, port)
