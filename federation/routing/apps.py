from django.apps import AppConfig


class RoutingConfig(AppConfig):
    name = "federation.routing"
    label = "routing"
    verbose_name = "Routing tables"

    def ready(self) -> None:
        # Every inventory and tenancy service records an audit event in its transaction, and
        # audit_record hands it to the one table scheduler (federation.core.changes), which
        # routing sets here: the debounced recompile after commit, or a publish at once.
        from federation.core.changes import table_scheduler_set
        from federation.core.metrics import STATE
        from federation.routing import services
        from federation.routing.metrics import FleetCollector

        table_scheduler_set(services.TABLE_SCHEDULER)
        STATE.register(FleetCollector())  # the fleet's gauges on /metrics, read per scrape
