from django.apps import AppConfig


class MeteringConfig(AppConfig):
    name = "federation.metering"
    label = "metering"
    verbose_name = "Usage and cost"

    def ready(self) -> None:
        from federation.metering.api import schema  # noqa: F401  (OpenAPI extension)
