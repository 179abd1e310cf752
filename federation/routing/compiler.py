"""Compile a region's routing table from a snapshot of the fleet. Pure: no Django, no I/O.

This first version lists the region's routable instances and the other regions (with their
RTT and the models they serve). Tenants, the cross-region demand split and signing come with
the federation work (issue 4); the document's schema is ``docs/routing-table.md`` and the edge
decodes it with ``regions.edge.table.decode_table``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

SCHEMA_VERSION = 1

#: Prefill throughput of an 8B model on one H100-80G, tokens/s. Prefill is compute bound, so
#: it scales with the accelerator's relative speed and inversely with the parameter count;
#: tensor parallelism pays all-reduces, so N GPUs give N^0.85 (the simulator's model too,
#: docs/engine-simulator.md).
REFERENCE_PREFILL_TOKENS_PER_S = 15_000.0
REFERENCE_PARAMS_B = 8.0
TP_EXPONENT = 0.85

#: Instances in these states receive traffic; a draining instance finishes what it has.
ROUTABLE_STATES = frozenset({"ready"})


@dataclass(frozen=True, slots=True)
class InstanceRow:
    name: str
    endpoint_url: str
    state: str
    region: str
    model: str
    role: str
    accelerator: str
    relative_speed: float
    tensor_parallel_size: int
    parameter_count_b: float
    max_num_seqs: int
    adapters: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class RegionRow:
    code: str
    status: str
    jurisdiction: str
    edge_url: str | None = None


@dataclass(frozen=True, slots=True)
class FleetSnapshot:
    regions: tuple[RegionRow, ...]
    instances: tuple[InstanceRow, ...]
    #: (source, target) -> round-trip milliseconds (measured preferred over configured).
    rtt_ms: dict[tuple[str, str], float] = field(default_factory=dict)


def prefill_tokens_per_s(
    *, relative_speed: float, tensor_parallel_size: int, params_b: float
) -> float:
    """Expected prefill throughput of one replica, tokens per second."""
    return (
        REFERENCE_PREFILL_TOKENS_PER_S
        * relative_speed
        * tensor_parallel_size**TP_EXPONENT
        * REFERENCE_PARAMS_B
        / params_b
    )


def _instance_entry(row: InstanceRow) -> dict[str, Any]:
    return {
        "id": row.name,
        "url": row.endpoint_url,
        "model": row.model,
        "adapters": list(row.adapters),
        "role": row.role,
        "accelerator": row.accelerator,
        "tp": row.tensor_parallel_size,
        "max_concurrency": row.max_num_seqs,
        "prefill_tokens_per_s": round(
            prefill_tokens_per_s(
                relative_speed=row.relative_speed,
                tensor_parallel_size=row.tensor_parallel_size,
                params_b=row.parameter_count_b,
            ),
            1,
        ),
        "state": "ready",
    }


def _models_by_region(instances: Iterable[InstanceRow]) -> dict[str, set[str]]:
    served: dict[str, set[str]] = {}
    for row in instances:
        if row.state in ROUTABLE_STATES:
            served.setdefault(row.region, set()).update((row.model, *row.adapters))
    return served


def compile_region_table(
    snapshot: FleetSnapshot, *, region: str, version: int, generated_at: str
) -> dict[str, Any]:
    """The routing-table document for ``region`` (a plain dict, ready for JSON)."""
    by_code = {r.code: r for r in snapshot.regions}
    if region not in by_code:
        raise KeyError(f"unknown region {region!r}")
    own = by_code[region]
    evacuated = own.status == "evacuated"
    instances = [
        _instance_entry(row)
        for row in sorted(snapshot.instances, key=lambda r: r.name)
        if row.region == region and row.state in ROUTABLE_STATES and not evacuated
    ]
    served = _models_by_region(snapshot.instances)
    remotes = []
    for other in sorted(snapshot.regions, key=lambda r: r.code):
        if other.code == region or other.status == "evacuated" or not other.edge_url:
            continue
        rtt = snapshot.rtt_ms.get((region, other.code), snapshot.rtt_ms.get((other.code, region)))
        if rtt is None:
            continue
        remotes.append(
            {
                "code": other.code,
                "edge_url": other.edge_url,
                "rtt_ms": rtt,
                "models": sorted(served.get(other.code, ())),
            }
        )
    return {
        "schema_version": SCHEMA_VERSION,
        "version": version,
        "region": region,
        "generated_at": generated_at,
        "instances": instances,
        "remote_regions": remotes,
    }
