from django.apps import AppConfig


class RoutingConfig(AppConfig):
    name = "federation.routing"
    label = "routing"
    verbose_name = "Routing tables"

    def ready(self) -> None:
        # Every inventory and tenancy service records an audit event in its transaction:
        # one receiver on that event schedules the debounced recompile after commit.
        from django.db.models.signals import post_save

        from federation.core.metrics import STATE
        from federation.core.models import AuditEvent
        from federation.routing import services
        from federation.routing.api import schema  # noqa: F401  (OpenAPI extension)
        from federation.routing.metrics import FleetCollector

        post_save.connect(
            services.recompile_on_audit_event,
            sender=AuditEvent,
            dispatch_uid="routing-recompile-on-audit",
        )
        STATE.register(FleetCollector())  # the fleet's gauges on /metrics, read per scrape
