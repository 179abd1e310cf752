"""LoRA adapters loaded where their demand appears.

A registered adapter that is not loaded in a region whose ready replicas serve its base model
is a cold model of that region's table (``federation/routing/compiler.py``): the edges hold its
requests (or send them to a region that has it) and report them in their heartbeats, which
queue the autoscale task. This pass, run by that task, loads such an adapter onto the ready
replicas of one deployment of its base model there with vLLM's runtime
``POST /v1/load_lora_adapter`` (the engine needs ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``
and ``--enable-lora``; the simulator accepts it) and, once every replica took it, adds it to the
deployment (audited, so the next table lists it and new replicas start with it). A refusal is
logged and audited, and tried again while the demand lasts.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from datetime import datetime, timedelta

import httpx
from django.core.exceptions import ValidationError

from federation.core.audit import audit_record
from federation.fleet import selectors
from federation.fleet.locks import advisory_lock
from federation.inventory import lifecycle
from federation.inventory import services as inventory
from federation.inventory.models import Deployment, Edge, Instance, LoraAdapter

logger = logging.getLogger(__name__)

#: vLLM answers 400 with this when the adapter is loaded already: as good as loaded.
ALREADY_LOADED = "has already been loaded"


def adapter_demand(now: datetime, fresh_s: float) -> dict[tuple[int, str], int]:
    """(region id, served name) -> requests the region's edges held or received for it, from
    their fresh heartbeats' cold reports."""
    since = now - timedelta(seconds=fresh_s)
    out: dict[tuple[int, str], int] = {}
    rows = Edge.objects.filter(last_heartbeat_at__gte=since).values_list("region_id", "cold_demand")
    for region, report in rows:
        if not isinstance(report, dict):
            continue
        for name, entry in report.items():
            try:
                if datetime.fromisoformat(entry["reported_at"]) < since:
                    continue
                count = int(entry.get("held", 0)) + int(entry.get("arrived", 0))
            except (KeyError, TypeError, ValueError):
                continue
            if count > 0:
                out[(region, name)] = out.get((region, name), 0) + count
    return out


def fleet_adapters_load(*, now: datetime, fresh_s: float, timeout_s: float) -> list[str]:
    """Load every adapter with demand in a region onto one deployment of its base model there
    that has ready replicas and lacks it; what was done, one line each."""
    demand = adapter_demand(now, fresh_s)
    if not demand:
        return []
    adapters = {a.name: a for a in LoraAdapter.objects.filter(name__in={n for _, n in demand})}
    done: list[str] = []
    for region, name in sorted(demand):
        adapter = adapters.get(name)
        if adapter is None:
            continue  # a model scaled to zero, the autoscaler's
        target = _target(adapter, region)
        if target is None:
            continue
        with advisory_lock(target.pk) as held:
            if held:
                line = deployment_adapter_load(
                    deployment=target, adapter=adapter, timeout_s=timeout_s
                )
                if line:
                    done.append(line)
    return done


def _target(adapter: LoraAdapter, region: int) -> Deployment | None:
    """The first (by id) provisioned mixed deployment of its base model in the region with a
    ready replica, unless one there serves the adapter already."""
    deployments = selectors.provisioned_deployments().filter(
        model_id=adapter.base_model_id, pool__region_id=region, role=Deployment.Role.MIXED
    )
    for dep in deployments:
        if any(a.pk == adapter.pk for a in dep.adapters.all()):
            return None
    for dep in deployments:
        if Instance.objects.filter(deployment=dep, state=lifecycle.READY).exists():
            return dep
    return None


def deployment_adapter_load(
    *, deployment: Deployment, adapter: LoraAdapter, timeout_s: float
) -> str:
    """Load ``adapter`` onto every ready replica of ``deployment``, then add it to the
    deployment; the caller holds its lock. What was done ('' when nothing)."""
    ready = list(Instance.objects.filter(deployment=deployment, state=lifecycle.READY))
    problems = load_on_engines([i.endpoint_url for i in ready], adapter, timeout_s=timeout_s)
    names = [i.name for i in ready]
    if problems:
        why = "; ".join(problems)[:300]
        logger.warning("%s: loading adapter %s refused: %s", deployment, adapter.name, why)
        audit_record(
            actor=None,
            action="fleet.adapter_load",
            obj=deployment,
            changes={"adapter": adapter.name, "instances": names, "refused": why},
        )
        return ""
    current = list(deployment.adapters.all())
    try:
        inventory.deployment_update(
            actor=None, deployment=deployment, data={"adapters": [*current, adapter]}
        )
    except ValidationError as exc:
        logger.warning("%s: adapter %s loaded but refused: %s", deployment, adapter.name, exc)
        return ""
    audit_record(
        actor=None,
        action="fleet.adapter_load",
        obj=deployment,
        changes={"adapter": adapter.name, "instances": names, "reason": "demand at the edges"},
    )
    return f"{deployment}: adapter {adapter.name} loaded on {', '.join(names)}"


def load_on_engines(urls: Sequence[str], adapter: LoraAdapter, *, timeout_s: float) -> list[str]:
    """``POST /v1/load_lora_adapter`` to each engine; the problems (none: all loaded it)."""
    problems = []
    body = {"lora_name": adapter.name, "lora_path": adapter.source}
    with httpx.Client(timeout=timeout_s, trust_env=False) as client:
        for url in urls:
            try:
                r = client.post(url.rstrip("/") + "/v1/load_lora_adapter", json=body)
            except httpx.HTTPError as exc:
                problems.append(f"{url}: {type(exc).__name__}")
                continue
            if r.status_code != 200 and not (r.status_code == 400 and ALREADY_LOADED in r.text):
                problems.append(f"{url}: {r.status_code} {r.text[:120]}")
    return problems
