from django.apps import AppConfig


class CoreConfig(AppConfig):
    name = "federation.core"
    label = "core"
    verbose_name = "fedinfer core"
