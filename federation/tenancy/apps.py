from django.apps import AppConfig


class TenancyConfig(AppConfig):
    name = "federation.tenancy"
    label = "tenancy"
    verbose_name = "Tenancy"
