from django.apps import AppConfig


class TenancyConfig(AppConfig):
    name = "federation.tenancy"
    label = "tenancy"
    verbose_name = "Tenancy"

    def ready(self) -> None:
        from federation.tenancy.api import schema  # noqa: F401  (OpenAPI extension)
