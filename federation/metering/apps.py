from django.apps import AppConfig


class MeteringConfig(AppConfig):
    name = "federation.metering"
    label = "metering"
    verbose_name = "Usage and cost"

    def ready(self) -> None:
        from federation.core.metrics import STATE
        from federation.metering.api import schema  # noqa: F401  (OpenAPI extension)
        from federation.metering.metrics import UsageBacklogCollector

        STATE.register(UsageBacklogCollector())  # the usage backlog's gauges on /metrics
