"""The Celery app of the control plane, configured from Django settings (``CELERY_*``).

Broker: ``CELERY_BROKER_URL`` — Redis in production and tests, a folder (kombu's filesystem
transport) in embedded mode. ``fedinfer worker`` runs a worker with beat embedded; the schedule is
``CELERY_BEAT_SCHEDULE`` in the settings.
"""

from __future__ import annotations

import os

from celery import Celery

from workers import metrics  # noqa: F401  (task metrics, served by `fedinfer worker`)

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "federation.settings")

app = Celery("fedinfer", include=["workers.tasks"])
app.config_from_object("django.conf:settings", namespace="CELERY")
