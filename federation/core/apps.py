from django.apps import AppConfig


class CoreConfig(AppConfig):
    name = "federation.core"
    label = "core"
    verbose_name = "fedinfer core"

    def ready(self) -> None:
        # Registers the OpenAPI extensions (drf-spectacular finds them by import).
        from federation.core.api import schema  # noqa: F401
