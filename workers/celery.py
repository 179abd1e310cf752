"""The Celery app of the control plane, configured from Django settings (``CELERY_*``).

Broker: ``CELERY_BROKER_URL`` — Redis in production and tests, a folder (kombu's filesystem
transport) in embedded mode. ``fedinfer worker`` runs a worker with beat embedded; the schedule is
``CELERY_BEAT_SCHEDULE`` in the settings.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
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


#: prctl(2) option: the signal the calling process gets when its parent dies.
_PR_SET_PDEATHSIG = 1


@signals.beat_embedded_init.connect
def _die_with_the_worker(**_: Any) -> None:
    """The beat a worker embeds is a child process: a worker killed outright (SIGKILL, the OOM
    killer) would leave it queueing the schedule with no worker of its own, and the worker's
    restart would add a second beat — every periodic task twice. Linux ends it with its
    parent."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"prctl(PR_SET_PDEATHSIG): {os.strerror(errno)}")
