"""``fedinfer engines``: the local provisioner's engines on this machine, and stopping them.

Engines outlive the worker that started them (so a restarted worker adopts them instead of
starting duplicates); after the worker is stopped for good, ``fedinfer engines --stop-all``
stops what it left. While a worker runs, stopping a live instance's engine makes the worker
fail that instance and start a replacement: scale a deployment down instead.
"""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser

from federation.inventory.models import Instance
from workers.provisioners.local import LocalProvisioner


class Command(BaseCommand):
    help = "List the local provisioner's engines (name, pid, URL, instance state) or stop them."

    def add_arguments(self, parser: CommandParser) -> None:
        group = parser.add_mutually_exclusive_group()
        group.add_argument("--stop", nargs="+", metavar="NAME", default=[])
        group.add_argument("--stop-all", action="store_true")

    def handle(self, *args: Any, **options: Any) -> None:
        provisioner = LocalProvisioner(
            settings.FEDINFER_LOCAL_ENGINES_DIR, engine=settings.FEDINFER_LOCAL_ENGINE
        )
        running = provisioner.running()
        names = sorted(running) if options["stop_all"] else options["stop"]
        unknown = sorted(set(names) - set(running))
        if unknown:
            raise CommandError(f"No engine named {', '.join(unknown)} runs here.")
        for name in names:
            provisioner.stop(name)
            self.stdout.write(f"stopped {name}")
        if names:
            return
        states = dict(Instance.objects.filter(name__in=running).values_list("name", "state"))
        for name, engine in sorted(running.items()):
            state = states.get(name, "no instance (orphan)")
            self.stdout.write(f"{name}\tpid {engine.detail['pid']}\t{engine.url}\t{state}")
