"""``fedinfer demo``: the whole platform on one machine, with simulated engines.

It loads the demo inventory and runs the federation the way production does: the
control-plane web server, the Celery worker (embedded broker under ``var/broker``) that
recompiles tables after every change and runs the fleet — its local provisioner starts a
simulated vLLM engine per replica, its autoscaler sets the replica counts of the Llama-8B
deployments from the edges' load reports, its failover replaces an engine that dies — and one
edge router per region in control-plane mode (its own credential, signed tables by long-poll,
heartbeats, last good table persisted). A small traffic generator (``federation.demo.traffic``)
sends requests from tenants of different jurisdictions along a compressed day
(``--day-minutes``), each region busiest in its local afternoon, so replicas come and go.

The demo prints where everything is, a fleet line (replicas per deployment, by state) with each
traffic summary, and supervises its processes as systemd would: one that exits is started again
(an edge comes back on its last good table and re-syncs); one that keeps exiting
(``RESTART_LIMIT`` times in ``RESTART_WINDOW_S``) stops the demo, naming it (no silent
half-platform). Engines are the worker's, not the demo's: it stops them when it ends.

The command is the entry point: its options, the order of the start-up and the supervision
loop. The demo fleet's rows for a run (clearing an earlier run, keys, replica counts, readiness)
are ``federation.demo.fleet_setup``'s; starting, waiting for and supervising the processes is
``federation.demo.run``'s.
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandParser
from django.db import connection
from django.utils import timezone

from federation.demo import fleet_setup, prometheus
from federation.demo.fleet import DEMO_PASSWORD
from federation.demo.fleet_setup import (
    AUTOSCALED_MAX,
    AUTOSCALED_MIN,
    AUTOSCALED_SEQS,
    DEMO_PREFIX,
)
from federation.demo.run import (
    DEMO_AUTOSCALER_ENV,
    FEDINFER,
    Interrupted,
    Run,
    write_private,
)
from federation.demo.usage import load_usage_history
from federation.inventory import services as inventory
from federation.inventory.models import Region
from federation.routing import services as routing
from federation.tenancy.models import Tenant
from federation.tenancy.selectors import tenant_permitted_regions
from regions.supervisor import Supervisor, free_port
from workers.celery import app as celery_app
from workers.provisioners.local import LocalProvisioner

#: Usage records ingested per transaction when the demo fills its history.
HISTORY_BATCH = 2000

#: Every deployment's first replicas ready: ten engines started on a small machine.
FLEET_TIMEOUT_S = 180.0


class Command(BaseCommand):
    help = "Run the whole platform on this machine with simulated engines."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--host", default="127.0.0.1")
        parser.add_argument("--port", type=int, default=8000, help="control-plane web port")
        parser.add_argument(
            "--edge-base-port",
            type=int,
            default=8100,
            help="edges listen on consecutive ports from here+1, regions in code order "
            "(0: any free ports, for tests)",
        )
        parser.add_argument(
            "--engines-per-deployment",
            type=int,
            default=1,
            help="replicas each deployment starts with (the autoscaler moves the Llama-8B ones)",
        )
        parser.add_argument(
            "--no-traffic", action="store_true", help="do not start the traffic generator"
        )
        parser.add_argument(
            "--traffic-rps",
            type=float,
            default=4.0,
            help="traffic generator requests per second: each region's at its peak (in all, "
            "with --day-minutes 0)",
        )
        parser.add_argument(
            "--day-minutes",
            type=float,
            default=10.0,
            help="minutes per simulated day of traffic, each region busiest in its local "
            "afternoon (0: a flat rate)",
        )
        parser.add_argument(
            "--day-start-hour",
            type=float,
            default=None,
            help="the simulated UTC hour the traffic starts at (default: now)",
        )
        parser.add_argument(
            "--traffic-summary-every",
            type=int,
            default=20,
            help="the traffic generator prints a summary line every this many answers",
        )
        parser.add_argument(
            "--usage-days",
            type=int,
            default=0,
            help="fill this many days of usage history before serving (reports, costs, budgets)",
        )
        parser.add_argument(
            "--prometheus",
            action="store_true",
            help="also run a real Prometheus (Debian package) scraping every process, with "
            "the alerting rules of platform/observability (data under var/demo/prometheus)",
        )
        parser.add_argument(
            "--prometheus-bin",
            default=prometheus.DEFAULT_BINARY,
            help="the Prometheus binary --prometheus runs",
        )
        parser.add_argument(
            "--exit-after",
            type=float,
            default=None,
            help="stop after this many seconds (for tests); default: until Ctrl-C",
        )

    def handle(self, *args: Any, **opts: Any) -> None:
        demo_dir = Path(settings.VAR_DIR) / "demo"
        for sub in ("logs", "engines", "edges"):
            (demo_dir / sub).mkdir(parents=True, exist_ok=True)
        (demo_dir / "credentials").mkdir(mode=0o700, exist_ok=True)
        call_command("migrate", interactive=False, verbosity=0)
        if connection.vendor == "sqlite":
            # Web, worker and heartbeats write concurrently; in WAL mode readers do not block
            # the writer. The mode is stored in the database file.
            with connection.cursor() as cursor:
                cursor.execute("PRAGMA journal_mode=WAL")
        call_command("loaddemo", stdout=self.stdout)
        run = Run(
            opts,
            demo_dir,
            Supervisor(demo_dir / "logs"),
            LocalProvisioner(demo_dir / "engines", engine="sim"),
            self.stdout.write,
        )
        fleet_setup.forget_previous_run(run.engines)
        fleet_setup.back_in_service(self.stdout.write)

        def on_signal(signum: int, frame: Any) -> None:
            run.stopping = True

        signal.signal(signal.SIGINT, on_signal)
        signal.signal(signal.SIGTERM, on_signal)
        try:
            summary = self._start(run)
            # It holds this run's API keys: readable by the demo's user only.
            endpoints = demo_dir / "endpoints.json"
            write_private(endpoints, json.dumps(summary, indent=2))
            self._print_summary(summary, demo_dir, traffic=not opts["no_traffic"])
            if not opts["no_traffic"]:
                run.start_traffic(endpoints)
            started = time.monotonic()
            shown = ("", -1)
            while not run.stopping:
                run.check_children()
                shown = run.show_fleet(shown)
                if (
                    opts["exit_after"] is not None
                    and time.monotonic() - started > opts["exit_after"]
                ):
                    break
                time.sleep(0.5)
        except Interrupted:
            pass
        finally:
            self.stdout.write("demo: stopping")
            # The worker first: it would replace the engines stopped next.
            run.sup.stop_all()
            fleet_setup.forget_previous_run(run.engines)

    def _usage_history(self, days: int) -> None:
        """Ingest ``days`` of generated usage and roll it up, as the worker would."""
        records = load_usage_history(days=days, now=timezone.now(), batch=HISTORY_BATCH)
        self.stdout.write(f"usage history: {records} requests over {days} days\n")

    def _start(self, run: Run) -> dict[str, Any]:
        fleet_setup.configure_fleet(run.opts["engines_per_deployment"])
        if run.opts["usage_days"] > 0:
            self._usage_history(run.opts["usage_days"])
        host, opts = run.host, run.opts
        keys = fleet_setup.fresh_keys()
        edges: dict[str, str] = {}
        #: Each edge's operator listener (/healthz, /metrics), never its public port.
        operators: dict[str, str] = {}
        credentials: dict[str, Path] = {}
        for offset, region in enumerate(Region.objects.order_by("code"), start=1):
            base = opts["edge_base_port"]
            url = f"http://{host}:{base + offset if base else free_port(host)}"
            ops_port = base + 100 + offset if base else free_port(host)
            operators[region.code] = f"http://127.0.0.1:{ops_port}"
            edge = inventory.edge_register(
                actor=None, region=region, name=f"{DEMO_PREFIX}{region.code}", url=url
            )
            credentials[region.code] = run.demo_dir / "credentials" / edge.name
            write_private(
                credentials[region.code],
                routing.edge_credential_rotate(actor=None, edge=edge) + "\n",
            )
            edges[region.code] = url
        # The tables of the fleet just set up; every later change is the worker's job. Tasks
        # queued during the set-up (and by earlier runs) are covered by this publish.
        routing.routing_tables_publish()
        celery_app.control.purge()
        web = f"http://{host}:{opts['port']}"
        web_env, worker_env = run.metrics_env()
        worker_env.update(run.fleet_env())
        run.start(
            "web",
            [*FEDINFER, "serve", "--no-migrate", "--host", host, "--port", str(opts["port"])],
            env=web_env,
        )
        run.start("worker", [*FEDINFER, "worker", "--pool", "solo"], env=worker_env)
        run.wait_http(f"{web}/api/schema/")
        run.wait(fleet_setup.fleet_ready, "every deployment's replicas ready", FLEET_TIMEOUT_S)
        run.start_edges(web, edges, operators, credentials)
        for url in operators.values():
            run.wait_http(f"{url}/healthz")
        tenants = Tenant.objects.filter(is_active=True).prefetch_related("allowed_regions")
        return {
            "autoscaler": {name: worker_env[name] for name in DEMO_AUTOSCALER_ENV},
            "prometheus": run.start_prometheus(web, worker_env, operators)
            if opts["prometheus"]
            else None,
            "control_plane": web,
            "edges": edges,
            "operators": operators,
            "instances": fleet_setup.ready_instances(),
            "api_keys": keys,
            # Each region's offset from UTC, for the traffic's day (its local afternoon).
            "utc_offsets": {
                r.code: round(r.longitude / 15.0, 1) for r in Region.objects.order_by("code")
            },
            "tenants": {
                t.slug: {"regions": tenant_permitted_regions(t)} for t in tenants if t.slug in keys
            },
        }

    def _print_summary(self, summary: dict[str, Any], demo_dir: Path, *, traffic: bool) -> None:
        web = summary["control_plane"]
        lines = [
            "",
            "fedinfer demo is running (Ctrl-C stops it)",
            f"  console        {web}/console/  (log in as operator, password {DEMO_PASSWORD!r})",
            f"  control plane  {web}/admin/  ·  API {web}/api/v1/  ·  docs {web}/api/docs/",
            f"  users          admin / operator / <tenant>-viewer, password {DEMO_PASSWORD!r}",
            "  worker         recompiles and publishes routing tables after every change; runs "
            "the engines (local provisioner), replaces one that dies, and autoscales the "
            f"Llama-8B deployments ({AUTOSCALED_MIN}..{AUTOSCALED_MAX} replicas of "
            f"{AUTOSCALED_SEQS} requests at once)",
            "  autoscaler     "
            + ", ".join(f"{name}={value}" for name, value in summary["autoscaler"].items()),
            "  supervision    a process that exits is started again (kill an edge: it comes "
            "back on its last good table); fleet lines show replicas by state",
        ]
        if summary["prometheus"]:
            lines.append(
                f"  prometheus     {summary['prometheus']}/graph  ·  alerts "
                f"{summary['prometheus']}/alerts  ·  scrapes every process"
            )
        for code, url in summary["edges"].items():
            ops = summary["operators"][code]
            lines.append(f"  edge {code:<13} {url}/v1/chat/completions  (operator: {ops}/metrics)")
        lines += [
            f"  instances      {len(summary['instances'])} simulated engines, "
            f"logs in {demo_dir / 'engines'}",
            f"  API keys       one per tenant, this run only: {demo_dir / 'endpoints.json'}",
            f"  logs           {demo_dir / 'logs'}",
            "  traffic        "
            + ("summary lines below (--no-traffic turns it off)" if traffic else "off"),
            f"  evacuate       POST {web}/api/v1/regions/<code>/evacuate/ as admin (README)",
            "",
        ]
        self.stdout.write("\n".join(lines))
