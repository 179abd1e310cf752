from django.apps import AppConfig


class FleetConfig(AppConfig):
    name = "federation.fleet"
    label = "fleet"
    verbose_name = "Fleet operations"
