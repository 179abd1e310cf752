from django.apps import AppConfig


class TelemetryConfig(AppConfig):
    """What edges report: heartbeats (liveness, table version, workers, instance health and
    load, budget spend, cold demand) folded into the inventory and routing's budget reports,
    and the autoscaler woken for cold demand. No models of its own: it writes through
    inventory's services and routing's ``budget_report_store``."""

    name = "federation.telemetry"
    label = "telemetry"
    verbose_name = "Edge telemetry"
