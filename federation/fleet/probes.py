"""The worker's own look at an engine: ``/health`` and ``/v1/models`` over HTTP."""

from __future__ import annotations

from dataclasses import dataclass

import httpx

from regions.engines.metrics import parse_vllm_metrics


@dataclass(frozen=True, slots=True)
class Probe:
    answers: bool  # /health answered 200
    serves_model: bool  # /v1/models lists the served model
    problem: str = ""
    #: Requests running or waiting in the engine (its /metrics), when asked for.
    in_flight: int | None = None


def probe_engine(
    url: str, served_model: str, *, timeout_s: float, with_load: bool = False
) -> Probe:
    """Ask the engine at ``url``; never raises (a failure is the answer). ``with_load`` also
    reads its ``/metrics``: a draining engine's own count of what it still runs."""
    try:
        # Loopback and cluster-internal engines: never through a proxy of the environment.
        with httpx.Client(timeout=timeout_s, trust_env=False) as client:
            health = client.get(url.rstrip("/") + "/health")
            if health.status_code != 200:
                return Probe(False, False, f"/health answered {health.status_code}")
            models = client.get(url.rstrip("/") + "/v1/models")
            metrics = client.get(url.rstrip("/") + "/metrics") if with_load else None
    except httpx.HTTPError as exc:
        return Probe(False, False, f"{type(exc).__name__}: {exc}"[:300])
    if models.status_code != 200:
        return Probe(True, False, f"/v1/models answered {models.status_code}")
    try:
        listed = {m.get("id") for m in models.json().get("data", []) if isinstance(m, dict)}
    except (ValueError, AttributeError):
        return Probe(True, False, "/v1/models answered no model list")
    if served_model not in listed:
        return Probe(True, False, f"/v1/models does not list {served_model!r} yet")
    in_flight = None
    if metrics is not None and metrics.status_code == 200:
        load = parse_vllm_metrics(metrics.text)
        in_flight = load.num_requests_running + load.num_requests_waiting
    return Probe(True, True, in_flight=in_flight)
