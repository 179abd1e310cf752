"""The Celery app of the control plane, configured from Django settings (``CELERY_*``).

Broker: ``CELERY_BROKER_URL`` — Redis in production and tests, a folder (kombu's filesystem
transport) in embedded mode. ``fedinfer worker`` runs a worker with beat embedded.
"""

from __future__ import annotations

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "federation.settings")

app = Celery("fedinfer", include=["workers.tasks"])
app.config_from_object("django.conf:settings", namespace="CELERY")


@app.on_after_configure.connect
def _schedule_periodic(sender: Celery, **kwargs: object) -> None:
    """Recompile every table periodically: telemetry changes without an inventory write."""
    from django.conf import settings

    from workers.tasks import routing_tables_publish_task

    sender.add_periodic_task(
        float(settings.FEDINFER_TABLES_REFRESH_SECONDS),
        routing_tables_publish_task.s(),
        name="routing tables: periodic recompile",
    )
