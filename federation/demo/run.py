"""The processes of one run of ``fedinfer demo``: how each is started (and started again), the
environments of the web and the worker, the edges, Prometheus and the traffic generator, the
waits of the start-up, and the supervision that restarts a process that exits and stops the
demo when one crash-loops (``RESTART_LIMIT`` exits in ``RESTART_WINDOW_S``).

A module of its own so that the ``demo`` command stays its entry point (options, start-up
order, supervision loop) while ``Run`` holds the run's state: its options, directory,
supervisor and engines, and ``stopping``, set by Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import os
import secrets
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.management.base import CommandError

from federation.demo import prometheus
from federation.demo.fleet_setup import DEMO_PREFIX, demo_deployments
from federation.demo.fleet_view import fleet_line, fleet_rows
from federation.inventory.models import Instance
from regions.supervisor import (
    Process,
    StartupError,
    Supervisor,
    free_port,
    http_status,
    wait_until,
)
from workers.provisioners.local import LocalProvisioner

FEDINFER = [sys.executable, "-m", "federation.cli"]
STARTUP_TIMEOUT_S = 60.0
#: A process that exits this many times within RESTART_WINDOW_S is crash-looping: the demo stops.
RESTART_LIMIT = 3
RESTART_WINDOW_S = 60.0
#: The worker's autoscaler in the demo: shorter than production's defaults (120, 60, 20 s) so
#: that replicas come and go within a compressed day. Values set in the environment win.
DEMO_AUTOSCALER_ENV = {
    "FEDINFER_AUTOSCALE_COOLDOWN_SECONDS": "20",
    "FEDINFER_AUTOSCALE_DOWN_WINDOW_SECONDS": "10",
    "FEDINFER_AUTOSCALE_SMOOTHING_SECONDS": "5",
}


def write_private(path: Path, text: str) -> None:
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
class Run:
    """One run of the demo: its options, directory and processes; ``stopping`` is set by
    Ctrl-C or SIGTERM and checked between steps (never acted on inside a signal handler).
    ``out`` writes a line to the demo's output."""

    opts: dict[str, Any]
    demo_dir: Path
    sup: Supervisor
    engines: LocalProvisioner
    out: Callable[[str], None]
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

    # --- supervision ----------------------------------------------------------------------

    def check_children(self) -> None:
        """Start again each process that exited, as systemd or Kubernetes would; a process
        crash-looping stops the demo."""
        for process in self.sup.exited():
            code = self.sup.stop(process)
            now = time.monotonic()
            exits = [t for t in self.exits.get(process.name, []) if now - t < RESTART_WINDOW_S]
            self.exits[process.name] = [*exits, now]
            if len(exits) + 1 >= RESTART_LIMIT:
                raise CommandError(
                    f"demo process(es) exited: {process.name} (code {code}), "
                    f"{len(exits) + 1} times in {RESTART_WINDOW_S:g} s; "
                    f"see {self.demo_dir / 'logs'}"
                )
            self.out(f"demo: {process.name} exited (code {code}); started again")
            self.restart(process.name)

    def show_fleet(self, shown: tuple[str, int]) -> tuple[str, int]:
        """Print the fleet line after each traffic summary, and whenever it changes; what was
        last shown (the line, the summaries seen). Prometheus's engine targets follow."""
        line = fleet_line(fleet_rows(demo_deployments()))
        if (line, self.summaries) != shown:
            self.out(line)
            self.update_engine_targets()
        return line, self.summaries

    def update_engine_targets(self) -> None:
        """The ready engines as Prometheus's engine targets (with ``--prometheus``), rewritten
        when they changed."""
        if self.engine_targets is None:
            return
        engines = sorted(
            Instance.objects.filter(
                deployment__in=demo_deployments(), state=Instance.State.READY
            ).values_list("deployment__pool__region__code", "endpoint_url")
        )
        if engines != self.scraped_engines:
            prometheus.write_engine_targets(self.engine_targets, engines)
            self.scraped_engines = engines

    # --- start-up -------------------------------------------------------------------------

    def fleet_env(self) -> dict[str, str]:
        """The worker's fleet settings: this run's engines folder, simulated engines, and the
        demo's shorter autoscaler windows unless the environment sets its own."""
        return {
            "FEDINFER_LOCAL_ENGINES_DIR": str(self.engines.engines_dir),
            "FEDINFER_LOCAL_ENGINE": "sim",
            **{name: os.environ.get(name, value) for name, value in DEMO_AUTOSCALER_ENV.items()},
        }

    def metrics_env(self) -> tuple[dict[str, str], dict[str, str]]:
        """With --prometheus: the web answers /metrics to a token of this run's only, and the
        worker serves its metrics on a free port. The environments of the web and the worker."""
        if not self.opts["prometheus"]:
            return dict(os.environ), dict(os.environ)
        token = secrets.token_urlsafe(32)
        write_private(self.demo_dir / "credentials" / "metrics-token", token)
        worker_port = str(free_port(self.host))
        return (
            {**os.environ, "FEDINFER_METRICS_TOKEN": token},
            {
                **os.environ,
                "FEDINFER_WORKER_METRICS_PORT": worker_port,
                "FEDINFER_WORKER_METRICS_ADDR": self.host,
            },
        )

    def start_edges(
        self,
        web: str,
        edges: dict[str, str],
        operators: dict[str, str],
        credentials: dict[str, Path],
    ) -> None:
        """One edge per region in control-plane mode, at ``edges[code]`` with its operator
        listener at ``operators[code]``."""
        # The verification key ring goes through the environment, not argv (visible in ps).
        ring = {
            "FEDINFER_TABLE_KEYS": (
                f"{settings.FEDINFER_TABLE_SIGNING_KEY_ID}={settings.FEDINFER_TABLE_SIGNING_KEY}"
            )
        }
        for code, url in edges.items():
            self.start(
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
                    str(self.demo_dir / "edges" / code),
                    "--host",
                    self.host,
                    "--port",
                    url.rsplit(":", 1)[1],
                    "--operator-port",
                    operators[code].rsplit(":", 1)[1],
                    # Usage goes to the control plane (no Redis in embedded mode).
                    "--usage-spool-dir",
                    str(self.demo_dir / "edges" / code / "usage"),
                ],
                env={**os.environ, **ring},
            )

    def start_prometheus(
        self, web: str, worker_env: dict[str, str], operators: dict[str, str]
    ) -> str:
        """Write the scrape configuration of every process, start Prometheus on a free port
        and wait until it is ready; its URL."""
        folder = self.demo_dir / "prometheus"
        self.engine_targets = folder / "engines.json"
        self.update_engine_targets()
        targets = prometheus.ScrapeTargets(
            control_plane=web,
            token_file=self.demo_dir / "credentials" / "metrics-token",
            worker=f"{self.host}:{worker_env['FEDINFER_WORKER_METRICS_PORT']}",
            edges=operators,
            engines_file=self.engine_targets,
        )
        try:
            config = prometheus.write_config(
                folder / "prometheus.yml",
                prometheus.scrape_config(targets, rule_files=prometheus.rule_files()),
            )
            listen = f"{self.host}:{free_port(self.host)}"
            argv = prometheus.prometheus_argv(
                self.opts["prometheus_bin"], config=config, data_dir=folder / "data", listen=listen
            )
        except prometheus.PrometheusUnavailable as exc:
            raise CommandError(f"--prometheus: {exc}") from exc
        self.start("prometheus", argv)
        url = f"http://{listen}"
        self.wait_http(f"{url}/-/ready")
        return url

    def start_traffic(self, endpoints: Path) -> None:
        def echo(line: str) -> None:
            self.out(line)
            if line.startswith("traffic ") and " | " in line:
                self.summaries += 1

        argv = [
            sys.executable,
            "-m",
            "federation.demo.traffic",
            "--endpoints",
            str(endpoints),
            "--rps",
            str(self.opts["traffic_rps"]),
            "--day-minutes",
            str(self.opts["day_minutes"]),
            "--summary-every",
            str(self.opts["traffic_summary_every"]),
        ]
        if self.opts["day_start_hour"] is not None:
            argv += ["--day-start-hour", str(self.opts["day_start_hour"])]
        self.start("traffic", argv, echo=echo)

    def wait(
        self,
        ready: Callable[[], bool],
        what: str,
        timeout: float = STARTUP_TIMEOUT_S,
    ) -> None:
        """Wait for a start-up step: Ctrl-C interrupts it, a child that exits fails it."""

        def ready_unless_interrupted() -> bool:
            if self.stopping:
                raise Interrupted
            return ready()

        try:
            wait_until(
                ready_unless_interrupted,
                what=what,
                timeout=timeout,
                watch=self.sup.processes,
                interval=0.2,
            )
        except StartupError as exc:
            raise CommandError(f"demo start-up failed: {exc}") from exc

    def wait_http(self, url: str) -> None:
        def answers() -> bool:
            status = http_status(url)
            return status is not None and status < 500

        self.wait(answers, url)
