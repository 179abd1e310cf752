"""What a publish compiles: the documents of the regions whose body changed since their latest
version. Pure; the publisher (``services.routing_tables_publish``) stores them."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from federation.routing.compiler import FleetPlan, compile_region_table, fleet_plan
from federation.routing.digest import body_hash
from federation.routing.snapshot import FleetSnapshot
from federation.routing.tenant_plan import TenantPlan


@dataclass(frozen=True, slots=True)
class CompiledTable:
    """A region's new document and its body's digest (``digest.body_hash``)."""

    region: str
    document: dict[str, Any]
    body_hash: str


def compile_changed_tables(
    snapshot: FleetSnapshot,
    *,
    latest: Mapping[str, tuple[int, str | None]],
    generated_at: str,
    reuse: TenantPlan | None = None,
) -> tuple[FleetPlan, list[CompiledTable]]:
    """The plan, and the documents of the regions in ``latest`` (code -> its latest version
    and body hash) whose body differs from their latest, each numbered one above it.

    ``reuse``: the previous compile's tenants (``FleetPlan.tenant_plan``), taken when its
    inputs are unchanged, as after an action on an instance: then the tenants, most of each
    table at scale, are neither planned, encoded nor digested again.
    """
    plan = fleet_plan(snapshot, reuse=reuse)
    tenants_digest = plan.tenant_plan.digest()
    changed = []
    for code in sorted(latest):
        version, latest_hash = latest[code]
        document = compile_region_table(
            snapshot, region=code, version=version + 1, generated_at=generated_at, plan=plan
        )
        digest = body_hash(document, tenants_digest=tenants_digest)
        if digest != latest_hash:
            changed.append(CompiledTable(code, document, digest))
    return plan, changed
