"""Load the fleet snapshot the pure compiler works on, in a fixed number of queries."""

from __future__ import annotations

from federation.inventory.models import Edge, Instance, Region, RegionLink
from federation.routing.compiler import FleetSnapshot, InstanceRow, RegionRow

#: vLLM's default ``--max-num-seqs`` when a deployment does not set it.
VLLM_DEFAULT_MAX_NUM_SEQS = 256


def fleet_snapshot() -> FleetSnapshot:
    # The first registered edge of a region receives its spill-over (issue 4 adds health).
    edge_urls: dict[str, str] = {}
    for code, url in Edge.objects.order_by("name").values_list("region__code", "url"):
        edge_urls.setdefault(code, url)
    regions = tuple(
        RegionRow(
            code=r.code,
            status=r.status,
            jurisdiction=r.jurisdiction,
            edge_url=edge_urls.get(r.code),
        )
        for r in Region.objects.all()
    )
    instances = []
    rows = Instance.objects.select_related(
        "deployment__model", "deployment__pool__region", "deployment__pool__accelerator"
    ).prefetch_related("deployment__adapters")
    for inst in rows:
        dep = inst.deployment
        instances.append(
            InstanceRow(
                name=inst.name,
                endpoint_url=inst.endpoint_url,
                state=inst.state,
                region=dep.pool.region.code,
                model=dep.model.name,
                role=dep.role,
                accelerator=dep.pool.accelerator.name,
                relative_speed=dep.pool.accelerator.relative_speed,
                tensor_parallel_size=dep.tensor_parallel_size,
                parameter_count_b=float(dep.model.parameter_count_b),
                max_num_seqs=int(dep.engine_args.get("max-num-seqs", VLLM_DEFAULT_MAX_NUM_SEQS)),
                adapters=tuple(sorted(a.name for a in dep.adapters.all())),
            )
        )
    rtt = {
        (link.source.code, link.target.code): (
            link.measured_rtt_ms if link.measured_rtt_ms is not None else link.rtt_ms
        )
        for link in RegionLink.objects.select_related("source", "target")
    }
    return FleetSnapshot(regions=regions, instances=tuple(instances), rtt_ms=rtt)
