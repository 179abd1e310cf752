from django.apps import AppConfig


class WorkersConfig(AppConfig):
    """Loads the Celery app in every process Django runs in (web, commands, tests), so that the
    domains queue tasks by name on the configured broker without importing ``workers``."""

    name = "workers"
    label = "workers"
    verbose_name = "Celery workers"

    def ready(self) -> None:
        from workers import celery  # noqa: F401  (creating the app makes it the current one)
