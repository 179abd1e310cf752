"""The Celery app of the control plane, configured from Django settings (``CELERY_*``).

Broker: ``CELERY_BROKER_URL`` — Redis in production and tests, a folder (kombu's filesystem
transport) in embedded mode. ``fedinfer worker`` runs a worker with beat embedded; the schedule is
``CELERY_BEAT_SCHEDULE`` in the settings.
"""

from __future__ import annotations

import os
from typing import Any

from celery import Celery, signals

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
