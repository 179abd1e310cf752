"""The demo fleet with one ready instance per deployment, its tables published and a few days
of generated usage: what the console's tests look at."""

from __future__ import annotations

from io import StringIO

from django.core.management import call_command
from django.utils import timezone

from federation.demo.fleet import DEMO_PASSWORD
from federation.demo.usage import load_usage_history
from federation.inventory import services as inventory
from federation.inventory.models import Deployment, Region
from federation.routing.services import routing_tables_publish

PASSWORD = DEMO_PASSWORD


def demo_fleet(
    *, usage_days: int = 0, endpoint: str = "http://{name}.invalid:8000", edges: bool = True
) -> None:
    """``loaddemo``, an edge per region (unless ``edges`` is false), one ready instance per
    deployment (``endpoint`` formats its URL with ``name``), tables published, and
    ``usage_days`` of usage ingested and rolled up."""
    call_command("loaddemo", stdout=StringIO())
    if edges:
        for region in Region.objects.all():
            inventory.edge_register(
                actor=None,
                region=region,
                name=f"edge-{region.code}",
                url=f"http://edge-{region.code}.invalid:8100",
            )
    deployments = Deployment.objects.select_related("pool__region", "model").order_by("pk")
    for i, dep in enumerate(deployments):
        name = f"{dep.pool.region.code}-{dep.pool.name}-{i}"
        inst = inventory.instance_create(
            actor=None, deployment=dep, name=name, endpoint_url=endpoint.format(name=name, i=i)
        )
        inventory.instance_bring_up(actor=None, instance=inst)
    routing_tables_publish()
    if usage_days:
        load_usage_history(days=usage_days, now=timezone.now())
