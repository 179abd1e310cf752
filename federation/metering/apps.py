from django.apps import AppConfig


class MeteringConfig(AppConfig):
    name = "federation.metering"
    label = "metering"
    verbose_name = "Usage and cost"
