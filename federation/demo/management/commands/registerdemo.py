"""``fedinfer registerdemo``: register engines and edges that run elsewhere (containers of
``platform/docker/compose.yaml``) for the demo fleet ``fedinfer loaddemo`` loaded.

``fedinfer demo`` starts its own processes and registers them; in containers each process is
started by the orchestrator, so this command does the registering: every ``--engine`` becomes
a ready instance of its deployment, every ``--edge`` an edge whose new credential is written,
readable by the owner only, to ``--credentials-dir/<edge name>`` (the edge container reads it);
then the tables are published. Run again, it registers anew (instances replaced, credentials
rotated), so a restarted topology starts clean.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import transaction

from federation.demo.fleet_setup import DEMO_PREFIX, demo_instance_name
from federation.demo.run import write_private
from federation.inventory import lifecycle
from federation.inventory import services as inventory
from federation.inventory.models import Deployment, Edge, Instance, Region
from federation.routing import services as routing


def _pair(value: str, what: str) -> tuple[str, str]:
    key, sep, url = value.partition("=")
    if not sep or not key or not url.startswith(("http://", "https://")):
        raise CommandError(f"--{what} {value!r}: expected KEY=http(s)://host:port")
    return key, url


def _deployment(key: str) -> Deployment:
    """``region/pool/role/model`` (the model last: its name has a slash) -> the deployment."""
    parts = key.split("/", 3)
    if len(parts) != 4:
        raise CommandError(f"--engine {key!r}: expected region/pool/role/model=URL")
    region, pool, role, model = parts
    found = Deployment.objects.filter(
        pool__region__code=region, pool__name=pool, role=role, model__name=model
    ).first()
    if found is None:
        raise CommandError(f"--engine {key!r}: no such deployment (run `fedinfer loaddemo` first)")
    return found


class Command(BaseCommand):
    help = "Register running engines and edges (containers) for the demo fleet."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--engine",
            action="append",
            default=[],
            metavar="REGION/POOL/ROLE/MODEL=URL",
            help="a running engine of that deployment (repeat)",
        )
        parser.add_argument(
            "--edge", action="append", default=[], metavar="REGION=URL", help="an edge (repeat)"
        )
        parser.add_argument(
            "--credentials-dir",
            type=Path,
            required=True,
            help="each edge's credential is written here, as the file named after the edge",
        )

    def handle(self, *args: Any, **opts: Any) -> None:
        engines = [(_deployment(k), u) for k, u in (_pair(v, "engine") for v in opts["engine"])]
        edges = [(k, u) for k, u in (_pair(v, "edge") for v in opts["edge"])]
        regions = {r.code: r for r in Region.objects.filter(code__in=[k for k, _ in edges])}
        if missing := sorted({k for k, _ in edges} - set(regions)):
            raise CommandError(f"--edge: no region {', '.join(missing)}")
        folder: Path = opts["credentials_dir"]
        folder.mkdir(parents=True, exist_ok=True)
        with transaction.atomic():
            counts: dict[int, int] = {}
            for dep, url in engines:
                index = counts[dep.pk] = counts.get(dep.pk, -1) + 1
                self._replace_instance(dep, demo_instance_name(dep, index), url)
            credentials = {}
            for code, url in edges:
                name = f"{DEMO_PREFIX}{code}"
                for old in Edge.objects.filter(name=name):
                    inventory.edge_delete(actor=None, edge=old)
                edge = inventory.edge_register(actor=None, region=regions[code], name=name, url=url)
                credentials[name] = routing.edge_credential_rotate(actor=None, edge=edge)
        for name, credential in credentials.items():
            write_private(folder / name, credential + "\n")
        versions = routing.routing_tables_publish()
        self.stdout.write(
            f"registered {len(engines)} engines and {len(edges)} edges "
            f"(credentials in {folder}); published {len(versions)} tables"
        )

    def _replace_instance(self, dep: Deployment, name: str, url: str) -> None:
        for old in Instance.objects.filter(name=name):
            if old.state not in lifecycle.TERMINAL_STATES:
                old = inventory.instance_transition(actor=None, instance=old, state="stopped")
            inventory.instance_delete(actor=None, instance=old)
        inst = inventory.instance_create(actor=None, deployment=dep, name=name, endpoint_url=url)
        inventory.instance_bring_up(actor=None, instance=inst)
