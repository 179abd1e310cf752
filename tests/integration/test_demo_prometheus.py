"""``fedinfer demo --prometheus``: the demo starts a real Prometheus that scrapes every one of
its processes (control plane with the run's metrics token, worker, each edge, each engine),
prints where it is, and its queries answer for every region; an engine the fleet replaces is
dropped from the targets and its replacement scraped."""

from __future__ import annotations

import os
import signal
import stat
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest

from regions.supervisor import Process, wait_until
from tests.integration.test_demo import start_demo  # noqa: F401  (fixture)
from workers.provisioners.local import LocalProvisioner

JOBS = ("fedinfer-control-plane", "fedinfer-worker", "fedinfer-edge", "fedinfer-engine")


@pytest.mark.slow
def test_demo_with_prometheus_scrapes_every_process(
    start_demo: Callable[..., tuple[Process, Any]],  # noqa: F811
) -> None:
    proc, endpoints = start_demo("--no-traffic", "--prometheus")
    base = endpoints["prometheus"]
    assert base.startswith("http://127.0.0.1:")
    demo_dir = proc.log.parent / "demo"
    token = demo_dir / "credentials" / "metrics-token"
    assert stat.S_IMODE(token.stat().st_mode) == 0o600
    # The web refuses /metrics without the run's token, even on loopback.
    assert httpx.get(endpoints["control_plane"] + "/metrics", timeout=5).status_code == 403

    def query(promql: str) -> list[dict[str, Any]]:
        body = httpx.get(f"{base}/api/v1/query", params={"query": promql}, timeout=5).json()
        assert body["status"] == "success", body
        result: list[dict[str, Any]] = body["data"]["result"]
        return result

    # Targets are first scraped at staggered offsets within the interval: wait for them all.
    targets = 2 + len(endpoints["edges"]) + len(endpoints["instances"])

    def all_up() -> bool:
        up = query("up")
        return len(up) == targets and all(s["value"][1] == "1" for s in up)

    wait_until(all_up, what="every demo process scraped", timeout=60, interval=0.5, watch=proc)
    up = query("up")
    assert {s["metric"]["job"] for s in up} == set(JOBS)
    edges = {s["metric"]["region"] for s in up if s["metric"]["job"] == "fedinfer-edge"}
    assert edges == set(endpoints["edges"])
    engines = [s for s in up if s["metric"]["job"] == "fedinfer-engine"]
    assert len(engines) == len(endpoints["instances"])
    versions = {s["metric"]["region"] for s in query("fedinfer_cp_table_version > 0")}
    assert versions == set(endpoints["edges"])
    assert f"prometheus     {base}/graph" in proc.log.read_text()

    # An engine dies; the worker replaces it; Prometheus follows (file-based discovery).
    victim, victim_url = endpoints["instances"][0]
    engines_dir = LocalProvisioner(demo_dir / "engines")
    os.killpg(int(engines_dir.running()[victim].detail["pid"]), signal.SIGKILL)
    gone = urlsplit(victim_url).netloc

    def replacement_scraped() -> bool:
        up = [s for s in query("up") if s["metric"]["job"] == "fedinfer-engine"]
        scraped = {s["metric"]["instance"] for s in up if s["value"][1] == "1"}
        return gone not in scraped and len(scraped) == len(endpoints["instances"])

    wait_until(replacement_scraped, what="the replacement engine scraped", timeout=90, watch=proc)
