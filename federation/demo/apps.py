from django.apps import AppConfig


class DemoConfig(AppConfig):
    """The demo: its fleet (``loaddemo``), the whole platform on one machine (``demo``) and
    the traffic generator. No models of its own."""

    name = "federation.demo"
    label = "demo"
    verbose_name = "Demo"
