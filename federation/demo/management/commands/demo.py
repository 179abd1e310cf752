"""``fedinfer demo``: the whole platform on one machine, with simulated engines.

It loads the demo inventory, starts simulated vLLM engines for every deployment (up to
``--engines-per-deployment`` each), registers them as instances and moves them to ready
through the lifecycle services, and runs the federation the way production does: the
control-plane web server, the Celery worker (embedded broker under ``var/broker``) that
recompiles tables after every change, and one edge router per region in control-plane mode
(its own credential, signed tables by long-poll, heartbeats, last good table persisted).
A small traffic generator (``federation.demo.traffic``) sends requests from tenants of
different jurisdictions. The demo prints where everything is and supervises the processes:
if one dies the demo says which and stops the rest (no silent half-platform).
"""

from __future__ import annotations

import functools
import json
import os
import secrets
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import connection
from django.utils import timezone

from federation.demo import prometheus
from federation.demo.fleet import DEMO_PASSWORD
from federation.demo.usage import load_usage_history
from federation.inventory import lifecycle
from federation.inventory import services as inventory
from federation.inventory.models import Deployment, Edge, GPUPool, Instance, Region
from federation.routing import services as routing
from federation.tenancy import services as tenancy
from federation.tenancy.models import ApiKey, Tenant
from federation.tenancy.selectors import tenant_permitted_regions
from regions.supervisor import (
    StartupError,
    Supervisor,
    file_written,
    free_port,
    http_status,
    wait_until,
)
from workers.celery import app as celery_app

#: Usage records ingested per transaction when the demo fills its history.
HISTORY_BATCH = 2000

DEMO_PREFIX = "demo-"
FEDINFER = [sys.executable, "-m", "federation.cli"]
STARTUP_TIMEOUT_S = 60.0


def _slug(text: str) -> str:
    out = "".join(c if c.isalnum() else "-" for c in text.lower())
    return "-".join(part for part in out.split("-") if part)


def demo_instance_name(dep: Deployment, index: int) -> str:
    """The name of a deployment's ``index``-th engine in the demo (also ``registerdemo``)."""
    return (
        f"{DEMO_PREFIX}{dep.pool.region.code}-{dep.pool.name}-"
        f"{_slug(dep.model.name.split('/')[-1])}-{dep.role}-{index}"
    )[:63].rstrip("-")


def _write_private(path: Path, text: str) -> None:
    """Write a secret readable by the demo's user only (created 0600, never widened)."""
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(text)


class Interrupted(Exception):
    """Ctrl-C or SIGTERM arrived: stop, this is not a failure."""


@dataclass
class _Run:
    """One run of the demo: its options, directory and processes; ``stopping`` is set by
    Ctrl-C or SIGTERM and checked between steps (never acted on inside a signal handler)."""

    opts: dict[str, Any]
    demo_dir: Path
    sup: Supervisor
    stopping: bool = False

    @property
    def host(self) -> str:
        return str(self.opts["host"])


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
        parser.add_argument("--engines-per-deployment", type=int, default=1)
        parser.add_argument(
            "--no-traffic", action="store_true", help="do not start the traffic generator"
        )
        parser.add_argument(
            "--traffic-rps", type=float, default=4.0, help="traffic generator requests per second"
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
        self._forget_previous_run()
        self._back_in_service()
        run = _Run(opts, demo_dir, Supervisor(demo_dir / "logs"))

        def on_signal(signum: int, frame: Any) -> None:
            run.stopping = True

        signal.signal(signal.SIGINT, on_signal)
        signal.signal(signal.SIGTERM, on_signal)
        try:
            summary = self._start(run)
            # It holds this run's API keys: readable by the demo's user only.
            endpoints = demo_dir / "endpoints.json"
            _write_private(endpoints, json.dumps(summary, indent=2))
            self._print_summary(summary, demo_dir, traffic=not opts["no_traffic"])
            if not opts["no_traffic"]:
                self._start_traffic(run, endpoints)
            started = time.monotonic()
            while not run.stopping:
                self._check_children(run)
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
            run.sup.stop_all()
            self._forget_previous_run()

    def _check_children(self, run: _Run) -> None:
        if exited := run.sup.exited():
            raise CommandError(
                "demo process(es) exited: "
                + ", ".join(f"{p.name} (code {p.returncode})" for p in exited)
                + f"; see {run.demo_dir / 'logs'}"
            )

    def _forget_previous_run(self) -> None:
        """Stop and remove the instances and edges a demo registered (ports change per run)."""
        for inst in Instance.objects.filter(name__startswith=DEMO_PREFIX):
            if inst.state not in lifecycle.TERMINAL_STATES:
                inst = inventory.instance_transition(actor=None, instance=inst, state="stopped")
            inventory.instance_delete(actor=None, instance=inst)
        for edge in Edge.objects.filter(name__startswith=DEMO_PREFIX):
            inventory.edge_delete(actor=None, edge=edge)

    def _back_in_service(self) -> None:
        """Every run starts with the whole fleet in service: an evacuation or cordon left by an
        earlier run would refuse the instances this run registers."""
        for region in Region.objects.exclude(status=Region.Status.ACTIVE).order_by("code"):
            inventory.region_restore(actor=None, region=region)
            self.stdout.write(f"demo: region {region.code} was {region.status}; restored")
        for pool in GPUPool.objects.exclude(status=GPUPool.Status.ACTIVE).select_related("region"):
            inventory.pool_uncordon(actor=None, pool=pool)
            self.stdout.write(f"demo: pool {pool.region.code}/{pool.name} was cordoned; uncordoned")

    def _fresh_keys(self) -> dict[str, str]:
        """Rotate each tenant's 'demo' key, so this run can show (and test with) its plaintext;
        the tables compiled next carry the new hashes."""
        keys = {}
        for api_key in ApiKey.objects.filter(name="demo", revoked_at__isnull=True).select_related(
            "tenant"
        ):
            keys[api_key.tenant.slug] = tenancy.api_key_rotate(
                actor=None, api_key=api_key
            ).plaintext
        return keys

    def _start_engines(self, run: _Run) -> None:
        """An engine-sim process per deployment, registered as ready instances."""
        per_dep = max(1, run.opts["engines_per_deployment"])
        pending: list[tuple[Deployment, int, Path]] = []
        deployments = Deployment.objects.select_related(
            "model", "pool__region", "pool__accelerator"
        ).prefetch_related("adapters")
        for dep in deployments:
            count = max(1, min(dep.desired_replicas, per_dep))
            name = (
                f"engines-{dep.pool.region.code}-{dep.pool.name}-{_slug(dep.model.name)}-{dep.role}"
            )
            ready_file = run.demo_dir / "engines" / f"{name}.json"
            ready_file.unlink(missing_ok=True)
            argv = [
                *FEDINFER,
                "engine-sim",
                "--count",
                str(count),
                "--host",
                run.host,
                "--port",
                "0",
                "--model",
                dep.model.name,
                "--accelerator",
                dep.pool.accelerator.name,
                "--tp",
                str(dep.tensor_parallel_size),
                "--params-billion",
                str(dep.model.parameter_count_b),
                "--max-num-seqs",
                str(dep.engine_args.get("max-num-seqs", 256)),
                "--seed",
                str(dep.pk),
                "--ready-file",
                str(ready_file),
            ]
            adapters = [f"{a.name}={a.source}" for a in dep.adapters.all()]
            if adapters:
                argv += ["--lora-modules", *adapters]
            run.sup.start(name, argv)
            pending.append((dep, count, ready_file))
        for dep, _count, ready_file in pending:
            self._wait(
                run,
                functools.partial(file_written, ready_file),
                f"the engines' ready file {ready_file}",
            )
            engines = json.loads(ready_file.read_text())["engines"]
            for engine in engines:
                name = demo_instance_name(dep, engine["index"])
                inst = inventory.instance_create(
                    actor=None, deployment=dep, name=name, endpoint_url=engine["url"]
                )
                inventory.instance_bring_up(actor=None, instance=inst)

    def _usage_history(self, days: int) -> None:
        """Ingest ``days`` of generated usage and roll it up, as the worker would."""
        records = load_usage_history(days=days, now=timezone.now(), batch=HISTORY_BATCH)
        self.stdout.write(f"usage history: {records} requests over {days} days\n")

    def _start(self, run: _Run) -> dict[str, Any]:
        self._start_engines(run)
        if run.opts["usage_days"] > 0:
            self._usage_history(run.opts["usage_days"])
        host, opts = run.host, run.opts
        keys = self._fresh_keys()
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
            _write_private(
                credentials[region.code],
                routing.edge_credential_rotate(actor=None, edge=edge) + "\n",
            )
            edges[region.code] = url
        # The tables of the fleet just set up; every later change is the worker's job. Tasks
        # queued during the set-up (and by earlier runs) are covered by this publish.
        routing.routing_tables_publish()
        celery_app.control.purge()
        web = f"http://{host}:{opts['port']}"
        web_env, worker_env = self._metrics_env(run)
        run.sup.start(
            "web",
            [*FEDINFER, "serve", "--no-migrate", "--host", host, "--port", str(opts["port"])],
            env=web_env,
        )
        run.sup.start("worker", [*FEDINFER, "worker", "--pool", "solo"], env=worker_env)
        self._wait_http(run, f"{web}/api/schema/")
        # The verification key ring goes through the environment, not argv (visible in ps).
        ring = {
            "FEDINFER_TABLE_KEYS": (
                f"{settings.FEDINFER_TABLE_SIGNING_KEY_ID}={settings.FEDINFER_TABLE_SIGNING_KEY}"
            )
        }
        for code, url in edges.items():
            run.sup.start(
                f"edge-{code}",
                [
                    *FEDINFER,
                    "edge",
                    "--region",
                    code,
                    "--control-plane",
                    web,
                    "--credential-file",
                    str(credentials[code]),
                    "--edge-name",
                    f"{DEMO_PREFIX}{code}",
                    "--state-dir",
                    str(run.demo_dir / "edges" / code),
                    "--host",
                    host,
                    "--port",
                    url.rsplit(":", 1)[1],
                    "--operator-port",
                    operators[code].rsplit(":", 1)[1],
                    # Usage goes to the control plane (no Redis in embedded mode).
                    "--usage-spool-dir",
                    str(run.demo_dir / "edges" / code / "usage"),
                ],
                env={**os.environ, **ring},
            )
        for url in operators.values():
            self._wait_http(run, f"{url}/healthz")
        tenants = Tenant.objects.filter(is_active=True).prefetch_related("allowed_regions")
        return {
            "prometheus": self._start_prometheus(run, web, worker_env, operators)
            if opts["prometheus"]
            else None,
            "control_plane": web,
            "edges": edges,
            "operators": operators,
            "instances": list(
                Instance.objects.filter(name__startswith=DEMO_PREFIX).values_list(
                    "name", "endpoint_url"
                )
            ),
            "api_keys": keys,
            "tenants": {
                t.slug: {"regions": tenant_permitted_regions(t)} for t in tenants if t.slug in keys
            },
        }

    def _metrics_env(self, run: _Run) -> tuple[dict[str, str], dict[str, str]]:
        """With --prometheus: the web answers /metrics to a token of this run's only, and the
        worker serves its metrics on a free port. The environments of the web and the worker."""
        if not run.opts["prometheus"]:
            return dict(os.environ), dict(os.environ)
        token = secrets.token_urlsafe(32)
        _write_private(run.demo_dir / "credentials" / "metrics-token", token)
        worker_port = str(free_port(run.host))
        return (
            {**os.environ, "FEDINFER_METRICS_TOKEN": token},
            {
                **os.environ,
                "FEDINFER_WORKER_METRICS_PORT": worker_port,
                "FEDINFER_WORKER_METRICS_ADDR": run.host,
            },
        )

    def _start_prometheus(
        self, run: _Run, web: str, worker_env: dict[str, str], operators: dict[str, str]
    ) -> str:
        """Write the scrape configuration of every process, start Prometheus on a free port
        and wait until it is ready; its URL."""
        engines = Instance.objects.filter(name__startswith=DEMO_PREFIX).values_list(
            "deployment__pool__region__code", "endpoint_url"
        )
        targets = prometheus.ScrapeTargets(
            control_plane=web,
            token_file=run.demo_dir / "credentials" / "metrics-token",
            worker=f"{run.host}:{worker_env['FEDINFER_WORKER_METRICS_PORT']}",
            edges=operators,
            engines=list(engines),
        )
        folder = run.demo_dir / "prometheus"
        try:
            config = prometheus.write_config(
                folder / "prometheus.yml",
                prometheus.scrape_config(targets, rule_files=prometheus.rule_files()),
            )
            listen = f"{run.host}:{free_port(run.host)}"
            argv = prometheus.prometheus_argv(
                run.opts["prometheus_bin"], config=config, data_dir=folder / "data", listen=listen
            )
        except prometheus.PrometheusUnavailable as exc:
            raise CommandError(f"--prometheus: {exc}") from exc
        run.sup.start("prometheus", argv)
        url = f"http://{listen}"
        self._wait_http(run, f"{url}/-/ready")
        return url

    def _start_traffic(self, run: _Run, endpoints: Path) -> None:
        run.sup.start(
            "traffic",
            [
                sys.executable,
                "-m",
                "federation.demo.traffic",
                "--endpoints",
                str(endpoints),
                "--rps",
                str(run.opts["traffic_rps"]),
                "--summary-every",
                str(run.opts["traffic_summary_every"]),
            ],
            echo=self.stdout.write,
        )

    def _wait(self, run: _Run, ready: Callable[[], bool], what: str) -> None:
        """Wait for a start-up step: Ctrl-C interrupts it, a child that exits fails it."""

        def ready_unless_interrupted() -> bool:
            if run.stopping:
                raise Interrupted
            return ready()

        try:
            wait_until(
                ready_unless_interrupted,
                what=what,
                timeout=STARTUP_TIMEOUT_S,
                watch=run.sup.processes,
                interval=0.2,
            )
        except StartupError as exc:
            raise CommandError(f"demo start-up failed: {exc}") from exc

    def _wait_http(self, run: _Run, url: str) -> None:
        def answers() -> bool:
            status = http_status(url)
            return status is not None and status < 500

        self._wait(run, answers, url)

    def _print_summary(self, summary: dict[str, Any], demo_dir: Path, *, traffic: bool) -> None:
        web = summary["control_plane"]
        lines = [
            "",
            "fedinfer demo is running (Ctrl-C stops it)",
            f"  console        {web}/console/  (log in as operator, password {DEMO_PASSWORD!r})",
            f"  control plane  {web}/admin/  ·  API {web}/api/v1/  ·  docs {web}/api/docs/",
            f"  users          admin / operator / <tenant>-viewer, password {DEMO_PASSWORD!r}",
            "  worker         recompiles and publishes routing tables after every change",
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
            f"  instances      {len(summary['instances'])} simulated engines",
            f"  API keys       one per tenant, this run only: {demo_dir / 'endpoints.json'}",
            f"  logs           {demo_dir / 'logs'}",
            "  traffic        "
            + ("summary lines below (--no-traffic turns it off)" if traffic else "off"),
            f"  evacuate       POST {web}/api/v1/regions/<code>/evacuate/ as admin (README)",
            "",
        ]
        self.stdout.write("\n".join(lines))
