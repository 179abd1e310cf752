"""A real Prometheus for ``fedinfer demo --prometheus``: the scrape configuration of every
process of the demo (the control plane with its metrics token, the worker's port, each edge's
operator listener, each engine), the alerting rules of ``platform/observability/rules``, and
the command line that runs ``/usr/bin/prometheus`` (Debian's ``prometheus`` package) on it. The
engines come and go as the fleet scales, so the demo keeps them in a file Prometheus rereads.

The same configuration is the reference for a deployment (platform/observability/README.md):
edges get their region as a target label, and the edge's per-engine label ``instance`` is
renamed ``engine``, since Prometheus keeps ``instance`` for the target it scraped.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import orjson
from django.conf import settings

#: The alerting rules shipped in the repository (not in the wheel: the demo runs from a checkout).
RULES_DIR = Path("platform") / "observability" / "rules"
DEFAULT_BINARY = "/usr/bin/prometheus"


class PrometheusUnavailable(RuntimeError):
    """The binary or the rules are missing: said at once, with what to install."""


@dataclass(frozen=True)
class ScrapeTargets:
    """Where the demo's processes answer ``/metrics``."""

    control_plane: str
    #: File holding the control plane's ``FEDINFER_METRICS_TOKEN`` (None: loopback access).
    token_file: Path | None
    #: The worker's ``FEDINFER_WORKER_METRICS_PORT`` address, ``host:port`` (None: not scraped).
    worker: str | None
    #: region -> the edge's operator listener URL.
    edges: Mapping[str, str]
    #: (region, engine URL) of every engine.
    engines: Sequence[tuple[str, str]] = field(default_factory=tuple)
    #: Where the engines' targets are kept for Prometheus to reread (file-based discovery:
    #: the fleet adds and removes engines as it runs); None: ``engines`` as a static list.
    engines_file: Path | None = None


def _hostport(url: str) -> str:
    return urlsplit(url).netloc


def scrape_config(
    targets: ScrapeTargets, *, rule_files: Sequence[Path], interval_s: float = 5.0
) -> dict[str, Any]:
    """prometheus.yml as a mapping (written as JSON, which Prometheus reads as YAML)."""
    interval = f"{interval_s:g}s"
    control_plane: dict[str, Any] = {
        "job_name": "fedinfer-control-plane",
        "metrics_path": "/metrics",
        "scheme": urlsplit(targets.control_plane).scheme or "http",
        "static_configs": [{"targets": [_hostport(targets.control_plane)]}],
    }
    if targets.token_file is not None:
        control_plane["authorization"] = {
            "type": "Bearer",
            "credentials_file": str(targets.token_file),
        }
    jobs = [control_plane]
    if targets.worker is not None:
        worker = {"targets": [targets.worker]}
        jobs.append({"job_name": "fedinfer-worker", "static_configs": [worker]})
    jobs.append(
        {
            "job_name": "fedinfer-edge",
            "static_configs": [
                {"targets": [_hostport(url)], "labels": {"region": region}}
                for region, url in sorted(targets.edges.items())
            ],
            "metric_relabel_configs": [
                {
                    "source_labels": ["exported_instance"],
                    "regex": "(.+)",
                    "target_label": "engine",
                },
                {"regex": "exported_instance", "action": "labeldrop"},
            ],
        }
    )
    if targets.engines_file is not None:
        jobs.append(
            {
                "job_name": "fedinfer-engine",
                "file_sd_configs": [{"files": [str(targets.engines_file)]}],
            }
        )
    elif targets.engines:
        jobs.append(
            {"job_name": "fedinfer-engine", "static_configs": engine_groups(targets.engines)}
        )
    return {
        "global": {"scrape_interval": interval, "evaluation_interval": interval},
        "rule_files": [str(p) for p in rule_files],
        "scrape_configs": jobs,
    }


def engine_groups(engines: Sequence[tuple[str, str]]) -> list[dict[str, Any]]:
    """Target groups of ``(region, engine URL)`` pairs, one per region (static or file-based
    discovery: the same form)."""
    by_region: dict[str, list[str]] = {}
    for region, url in engines:
        by_region.setdefault(region, []).append(_hostport(url))
    return [
        {"targets": sorted(hosts), "labels": {"region": region}}
        for region, hosts in sorted(by_region.items())
    ]


def write_engine_targets(path: Path, engines: Sequence[tuple[str, str]]) -> None:
    """Replace the engines' targets file at once (written aside, then renamed: Prometheus never
    reads half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    aside = path.with_suffix(".tmp")
    aside.write_bytes(orjson.dumps(engine_groups(engines), option=orjson.OPT_INDENT_2))
    aside.replace(path)


def rule_files(base_dir: Path | None = None) -> list[Path]:
    """The repository's alerting rules; an error naming the folder when there are none."""
    folder = (base_dir or Path(settings.BASE_DIR)) / RULES_DIR
    found = sorted(folder.glob("*.yaml"))
    if not found:
        raise PrometheusUnavailable(f"no alerting rules in {folder}: run from a fedinfer checkout")
    return found


def write_config(path: Path, config: Mapping[str, Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(orjson.dumps(config, option=orjson.OPT_INDENT_2))
    return path


def prometheus_argv(binary: str, *, config: Path, data_dir: Path, listen: str) -> list[str]:
    """The command line of a Prometheus on ``listen`` (``host:port``) keeping its data in
    ``data_dir``; an error when ``binary`` is not there."""
    if not Path(binary).is_file():
        raise PrometheusUnavailable(
            f"{binary} not found: install Prometheus (Debian/Ubuntu: apt-get install prometheus)"
        )
    data_dir.mkdir(parents=True, exist_ok=True)
    return [
        binary,
        f"--config.file={config}",
        f"--storage.tsdb.path={data_dir}",
        f"--web.listen-address={listen}",
        "--storage.tsdb.retention.time=2d",
        "--log.level=warn",
    ]
