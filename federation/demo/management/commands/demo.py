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
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import connection
from django.utils import timezone

from federation.demo import fleet, prometheus
from federation.demo.fleet import DEMO_PASSWORD
from federation.demo.fleet_view import fleet_line, fleet_rows
from federation.demo.usage import load_usage_history
from federation.inventory import lifecycle
from federation.inventory import services as inventory
from federation.inventory.models import Deployment, Edge, GPUPool, Instance, Region
from federation.routing import services as routing
from federation.tenancy import services as tenancy
from federation.tenancy.models import ApiKey, Tenant
from federation.tenancy.selectors import tenant_permitted_regions
from regions.supervisor import (
    Process,
    StartupError,
    Supervisor,
    free_port,
    http_status,
    wait_until,
)
from workers.celery import app as celery_app
from workers.provisioners.local import LocalProvisioner

#: Usage records ingested per transaction when the demo fills its history.
HISTORY_BATCH = 2000

DEMO_PREFIX = "demo-"
FEDINFER = [sys.executable, "-m", "federation.cli"]
STARTUP_TIMEOUT_S = 60.0
#: Every deployment's first replicas ready: ten engines started on a small machine.
FLEET_TIMEOUT_S = 180.0
#: A process that exits this many times within RESTART_WINDOW_S is crash-looping: the demo stops.
RESTART_LIMIT = 3
RESTART_WINDOW_S = 60.0
#: The demo's autoscaled deployments: the mixed ones of the model every tenant's traffic asks
#: for, between these bounds, each replica running AUTOSCALED_SEQS requests at once (a small
#: replica, so that a few requests per second fill one at a region's peak).
AUTOSCALED_MODEL = "meta-llama/Llama-3.1-8B-Instruct"
AUTOSCALED_MIN, AUTOSCALED_MAX = 1, 3
AUTOSCALED_SEQS = 2
#: The worker's autoscaler in the demo: shorter than production's defaults (120, 60, 20 s) so
#: that replicas come and go within a compressed day. Values set in the environment win.
DEMO_AUTOSCALER_ENV = {
    "FEDINFER_AUTOSCALE_COOLDOWN_SECONDS": "20",
    "FEDINFER_AUTOSCALE_DOWN_WINDOW_SECONDS": "10",
    "FEDINFER_AUTOSCALE_SMOOTHING_SECONDS": "5",
}


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


@dataclass(frozen=True, slots=True)
class _Spec:
    """How a supervised process was started, so that it can be started again."""

    argv: list[str]
    env: dict[str, str] | None
    echo: Callable[[str], None] | None


@dataclass
class _Run:
    """One run of the demo: its options, directory and processes; ``stopping`` is set by
    Ctrl-C or SIGTERM and checked between steps (never acted on inside a signal handler)."""

    opts: dict[str, Any]
    demo_dir: Path
    sup: Supervisor
    engines: LocalProvisioner
    stopping: bool = False
    specs: dict[str, _Spec] = field(default_factory=dict)
    #: When each process exited on its own, recently (crash-loop detection).
    exits: dict[str, list[float]] = field(default_factory=dict)
    #: Traffic summary lines seen (a fleet line follows each).
    summaries: int = 0
    #: Prometheus's engine targets file (``--prometheus``) and the engines last written there.
    engine_targets: Path | None = None
    scraped_engines: list[tuple[str, str]] = field(default_factory=list)

    @property
    def host(self) -> str:
        return str(self.opts["host"])

    def start(
        self,
        name: str,
        argv: list[str],
        *,
        env: dict[str, str] | None = None,
        echo: Callable[[str], None] | None = None,
    ) -> Process:
        self.specs[name] = _Spec(argv, env, echo)
        return self.sup.start(name, argv, env=env, echo=echo)

    def restart(self, name: str) -> Process:
        spec = self.specs[name]
        return self.sup.start(name, spec.argv, env=spec.env, echo=spec.echo)


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
        run = _Run(
            opts,
            demo_dir,
            Supervisor(demo_dir / "logs"),
            LocalProvisioner(demo_dir / "engines", engine="sim"),
        )
        self._forget_previous_run(run.engines)
        self._back_in_service()

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
            shown = ("", -1)
            while not run.stopping:
                self._check_children(run)
                shown = self._show_fleet(run, shown)
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
            self._forget_previous_run(run.engines)

    def _check_children(self, run: _Run) -> None:
        """Start again each process that exited, as systemd or Kubernetes would; a process
        crash-looping stops the demo."""
        for process in run.sup.exited():
            code = run.sup.stop(process)
            now = time.monotonic()
            exits = [t for t in run.exits.get(process.name, []) if now - t < RESTART_WINDOW_S]
            run.exits[process.name] = [*exits, now]
            if len(exits) + 1 >= RESTART_LIMIT:
                raise CommandError(
                    f"demo process(es) exited: {process.name} (code {code}), "
                    f"{len(exits) + 1} times in {RESTART_WINDOW_S:g} s; "
                    f"see {run.demo_dir / 'logs'}"
                )
            self.stdout.write(f"demo: {process.name} exited (code {code}); started again")
            run.restart(process.name)

    def _show_fleet(self, run: _Run, shown: tuple[str, int]) -> tuple[str, int]:
        """Print the fleet line after each traffic summary, and whenever it changes; what was
        last shown (the line, the summaries seen). Prometheus's engine targets follow."""
        line = fleet_line(fleet_rows(_demo_deployments()))
        if (line, run.summaries) != shown:
            self.stdout.write(line)
            self._update_engine_targets(run)
        return line, run.summaries

    def _update_engine_targets(self, run: _Run) -> None:
        """The ready engines as Prometheus's engine targets (with ``--prometheus``), rewritten
        when they changed."""
        if run.engine_targets is None:
            return
        engines = sorted(
            Instance.objects.filter(
                deployment__in=_demo_deployments(), state=Instance.State.READY
            ).values_list("deployment__pool__region__code", "endpoint_url")
        )
        if engines != run.scraped_engines:
            prometheus.write_engine_targets(run.engine_targets, engines)
            run.scraped_engines = engines

    def _forget_previous_run(self, engines: LocalProvisioner) -> None:
        """Stop the engines and remove the instances and edges of a demo run (ports change per
        run): the worker is not running, so nothing replaces them."""
        for name in engines.running():
            engines.stop(name)
        for inst in Instance.objects.filter(deployment__in=_demo_deployments()):
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

    def _fleet_configure(self, run: _Run) -> None:
        """Hand the demo's pools to the worker's local provisioner and set each deployment's
        replicas: the mixed Llama-8B ones autoscaled within AUTOSCALED_MIN..MAX, the others
        fixed at ``--engines-per-deployment``."""
        wanted = max(1, run.opts["engines_per_deployment"])
        for dep in _demo_deployments():
            if dep.pool.provisioner != GPUPool.Provisioner.LOCAL:
                inventory.pool_update(
                    actor=None, pool=dep.pool, data={"provisioner": GPUPool.Provisioner.LOCAL}
                )
            if dep.model.name == AUTOSCALED_MODEL and dep.role == Deployment.Role.MIXED:
                data: dict[str, Any] = {
                    "autoscale": True,
                    "min_replicas": AUTOSCALED_MIN,
                    "max_replicas": AUTOSCALED_MAX,
                    "desired_replicas": min(max(wanted, AUTOSCALED_MIN), AUTOSCALED_MAX),
                    "engine_args": {**dep.engine_args, "max-num-seqs": AUTOSCALED_SEQS},
                }
            else:
                data = {
                    "autoscale": False,
                    "scale_to_zero_after_s": None,
                    "min_replicas": min(dep.min_replicas, wanted),
                    "max_replicas": max(dep.max_replicas, wanted),
                    "desired_replicas": wanted,
                }
            inventory.deployment_update(actor=None, deployment=dep, data=data)

    def _fleet_ready(self) -> bool:
        """Every deployment has its desired replicas ready (the worker brought them up)."""
        for dep in _demo_deployments():
            ready = dep.instances.filter(state=Instance.State.READY).count()
            if ready < dep.desired_replicas:
                return False
        return True

    def _usage_history(self, days: int) -> None:
        """Ingest ``days`` of generated usage and roll it up, as the worker would."""
        records = load_usage_history(days=days, now=timezone.now(), batch=HISTORY_BATCH)
        self.stdout.write(f"usage history: {records} requests over {days} days\n")

    def _start(self, run: _Run) -> dict[str, Any]:
        self._fleet_configure(run)
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
        worker_env.update(self._fleet_env(run))
        run.start(
            "web",
            [*FEDINFER, "serve", "--no-migrate", "--host", host, "--port", str(opts["port"])],
            env=web_env,
        )
        run.start("worker", [*FEDINFER, "worker", "--pool", "solo"], env=worker_env)
        self._wait_http(run, f"{web}/api/schema/")
        self._wait(run, self._fleet_ready, "every deployment's replicas ready", FLEET_TIMEOUT_S)
        # The verification key ring goes through the environment, not argv (visible in ps).
        ring = {
            "FEDINFER_TABLE_KEYS": (
                f"{settings.FEDINFER_TABLE_SIGNING_KEY_ID}={settings.FEDINFER_TABLE_SIGNING_KEY}"
            )
        }
        for code, url in edges.items():
            run.start(
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
            "autoscaler": {name: worker_env[name] for name in DEMO_AUTOSCALER_ENV},
            "prometheus": self._start_prometheus(run, web, worker_env, operators)
            if opts["prometheus"]
            else None,
            "control_plane": web,
            "edges": edges,
            "operators": operators,
            "instances": _ready_instances(),
            "api_keys": keys,
            # Each region's offset from UTC, for the traffic's day (its local afternoon).
            "utc_offsets": {
                r.code: round(r.longitude / 15.0, 1) for r in Region.objects.order_by("code")
            },
            "tenants": {
                t.slug: {"regions": tenant_permitted_regions(t)} for t in tenants if t.slug in keys
            },
        }

    def _fleet_env(self, run: _Run) -> dict[str, str]:
        """The worker's fleet settings: this run's engines folder, simulated engines, and the
        demo's shorter autoscaler windows unless the environment sets its own."""
        return {
            "FEDINFER_LOCAL_ENGINES_DIR": str(run.engines.engines_dir),
            "FEDINFER_LOCAL_ENGINE": "sim",
            **{name: os.environ.get(name, value) for name, value in DEMO_AUTOSCALER_ENV.items()},
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
        folder = run.demo_dir / "prometheus"
        run.engine_targets = folder / "engines.json"
        self._update_engine_targets(run)
        targets = prometheus.ScrapeTargets(
            control_plane=web,
            token_file=run.demo_dir / "credentials" / "metrics-token",
            worker=f"{run.host}:{worker_env['FEDINFER_WORKER_METRICS_PORT']}",
            edges=operators,
            engines_file=run.engine_targets,
        )
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
        run.start("prometheus", argv)
        url = f"http://{listen}"
        self._wait_http(run, f"{url}/-/ready")
        return url

    def _start_traffic(self, run: _Run, endpoints: Path) -> None:
        def echo(line: str) -> None:
            self.stdout.write(line)
            if line.startswith("traffic ") and " | " in line:
                run.summaries += 1

        argv = [
            sys.executable,
            "-m",
            "federation.demo.traffic",
            "--endpoints",
            str(endpoints),
            "--rps",
            str(run.opts["traffic_rps"]),
            "--day-minutes",
            str(run.opts["day_minutes"]),
            "--summary-every",
            str(run.opts["traffic_summary_every"]),
        ]
        if run.opts["day_start_hour"] is not None:
            argv += ["--day-start-hour", str(run.opts["day_start_hour"])]
        run.start("traffic", argv, echo=echo)

    def _wait(
        self,
        run: _Run,
        ready: Callable[[], bool],
        what: str,
        timeout: float = STARTUP_TIMEOUT_S,
    ) -> None:
        """Wait for a start-up step: Ctrl-C interrupts it, a child that exits fails it."""

        def ready_unless_interrupted() -> bool:
            if run.stopping:
                raise Interrupted
            return ready()

        try:
            wait_until(
                ready_unless_interrupted,
                what=what,
                timeout=timeout,
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


def _demo_deployments() -> list[Deployment]:
    """The deployments of the demo fleet (``federation.demo.fleet``), with pool and model."""
    keys = {(region, pool, model, role) for region, pool, model, role, *_ in fleet.DEPLOYMENTS}
    found = Deployment.objects.select_related("pool__region", "model").order_by("pk")
    return [
        dep
        for dep in found
        if (dep.pool.region.code, dep.pool.name, dep.model.name, dep.role) in keys
    ]


def _ready_instances() -> list[tuple[str, str]]:
    """(name, URL) of the demo's ready instances."""
    ready = Instance.objects.filter(
        deployment__in=_demo_deployments(), state=Instance.State.READY
    ).order_by("name")
    return list(ready.values_list("name", "endpoint_url"))
