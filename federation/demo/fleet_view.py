"""The demo's fleet line: replicas per deployment and their states, one line, so that a user
watching ``fedinfer demo`` sees the autoscaler follow the traffic and failover replace engines.

    fleet | ap-southeast/h100-neo/Llama-3.1-8B-Instruct want 2: ready 1, loading 1 | … | 5 fixed
    deployments want 5: ready 5

Autoscaled deployments are listed one by one (``want N`` is ``desired_replicas``, then the live
instances by state); the fixed ones are summed up. :func:`fleet_line` is pure; :func:`fleet_rows`
reads the inventory.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from federation.inventory import lifecycle
from federation.inventory.models import Deployment, Instance

#: States in the order a replica goes through them (the line lists them so).
STATE_ORDER = ("pending", "loading", "warming", "ready", "draining")


@dataclass(frozen=True, slots=True)
class DeploymentRow:
    label: str  # region/pool/model
    autoscale: bool
    desired: int
    states: Counter[str]  # live instances by state


def _states(states: Counter[str]) -> str:
    ordered = sorted(states, key=lambda s: (STATE_ORDER.index(s), s))
    return ", ".join(f"{state} {states[state]}" for state in ordered if states[state])


def fleet_line(rows: list[DeploymentRow]) -> str:
    """``fleet | <autoscaled deployment> want <desired>: <state> <n>, … | … | <k> fixed
    deployments want <desired>: …``."""
    parts = [
        f"{row.label} want {row.desired}: {_states(row.states) or 'none'}"
        for row in rows
        if row.autoscale
    ]
    fixed = [row for row in rows if not row.autoscale]
    if fixed:
        states = sum((row.states for row in fixed), Counter[str]())
        desired = sum(row.desired for row in fixed)
        parts.append(f"{len(fixed)} fixed deployments want {desired}: {_states(states) or 'none'}")
    return " | ".join(["fleet", *parts])


def fleet_rows(deployments: list[Deployment]) -> list[DeploymentRow]:
    """The rows of ``deployments`` as they are now (live instances only)."""
    live: dict[int, Counter[str]] = {dep.pk: Counter() for dep in deployments}
    instances = Instance.objects.filter(deployment__in=deployments).exclude(
        state__in=lifecycle.TERMINAL_STATES
    )
    for deployment_id, state in instances.values_list("deployment_id", "state"):
        live[deployment_id][state] += 1
    rows = []
    for dep in Deployment.objects.filter(pk__in=live).select_related("pool__region", "model"):
        label = f"{dep.pool.region.code}/{dep.pool.name}/{dep.model.name.split('/')[-1]}"
        if dep.role != Deployment.Role.MIXED:
            label += f"/{dep.role}"
        rows.append(DeploymentRow(label, dep.autoscale, dep.desired_replicas, live[dep.pk]))
    return sorted(rows, key=lambda row: row.label)
