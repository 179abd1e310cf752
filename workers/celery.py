"""The Celery app of the control plane, configured from Django settings (``CELERY_*``).

Broker: ``CELERY_BROKER_URL`` — Redis in production and tests, a folder (kombu's filesystem
transport) in embedded mode. ``fedinfer worker`` runs a worker with beat embedded; the schedule is
``CELERY_BEAT_SCHEDULE`` in the settings.
"""

from __future__ import annotations

import multiprocessing
import os
from typing import Any

from celery import Celery, signals

from regions.supervisor import die_with_parent
from workers import metrics  # noqa: F401  (task metrics, served by `fedinfer worker`)

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "federation.settings")

app = Celery("fedinfer", include=["workers.tasks"])
app.config_from_object("django.conf:settings", namespace="CELERY")


@signals.worker_init.connect
def _trace_tasks(**_: Any) -> None:
    """Spans of the tasks when FEDINFER_OTLP_ENDPOINT is set, before the pool forks (its
    processes inherit the instrumentation; the span exporter restarts its thread in each)."""
    from federation.core.tracing import trace_worker

    trace_worker()


@signals.beat_embedded_init.connect
def _die_with_the_worker(**_: Any) -> None:
    """The beat a worker embeds is a child process: a worker killed outright (SIGKILL, the OOM
    killer) would leave it queueing the schedule with no worker of its own, and the worker's
    restart would add a second beat — every periodic task twice. Linux ends it with its
    parent, and one whose worker died before it could ask ends at once (that race left a beat
    behind in CI: a worker killed 0.4 s after its start)."""
    parent = multiprocessing.parent_process()
    die_with_parent(parent.pid if parent is not None and parent.pid else os.getppid())
