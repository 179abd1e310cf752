from django.apps import AppConfig


class InventoryConfig(AppConfig):
    name = "federation.inventory"
    label = "inventory"
    verbose_name = "Inventory"
