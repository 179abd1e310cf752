"""Where an edge would send one request, and why: the edge's own pure pieces (admission's
policy check, the spill-over plan, ramps) applied to a routing table, with no edge process.

What only a running edge knows — live queue lengths, which engine caches the prompt's prefix,
where a session is pinned — is not here: inside the chosen region the edge picks the instance
with the lowest expected TTFT (``docs/edge-scheduling.md``); this says which region and why.
"""

from __future__ import annotations

from dataclasses import dataclass

from regions.edge.policy import (
    Admission,
    EdgeError,
    Remote,
    TenantState,
    first_targets,
    ramp_point,
    refusal,
    spill_plan,
)
from regions.tables.schema import Instance, RoutingTable, TenantPolicy

#: Why a request is served where it is (the edge's ``Spill.why`` and its local case).
REASONS = {
    "local": "served in the region of the edge it reached",
    "residency": "the tenant may not be served in this region: forwarded to an allowed one",
    "not_local": "this region does not serve the model: forwarded",
    "ramp": "this region is coming back (ramping): the request's point is above its share",
    "cold": "the model is scaled to zero in this region: another allowed region serves it "
    "meanwhile, else it is held here until a replica starts",
}


@dataclass(frozen=True, slots=True)
class Decision:
    """``region`` serves it (None: refused with ``status`` and ``message``)."""

    origin: str
    region: str | None
    reason: str
    status: int = 200
    message: str = ""
    #: The other regions the edge would try next, in order.
    fallbacks: tuple[str, ...] = ()
    #: Candidates in the serving region's table when that is the origin's own.
    candidates: tuple[Instance, ...] = ()

    @property
    def key(self) -> tuple[str | None, str]:
        """What a preview compares: the place, or the refusal."""
        return (self.region, self.reason if self.region is None else "")

    @property
    def explanation(self) -> str:
        return self.message if self.region is None else REASONS[self.reason]


def local_candidates(table: RoutingTable, model: str) -> tuple[Instance, ...]:
    """Instances of the table that serve ``model`` (or an adapter of that name) first-hand."""
    return tuple(
        i
        for i in table.instances
        if (i.model == model or model in i.adapters) and i.role in ("mixed", "prefill")
    )


def tenant_refusals(table: RoutingTable, tenant: TenantPolicy) -> dict[str, str]:
    for cls in table.residency_classes:
        if cls.id == tenant.residency_class:
            return dict(cls.refusals)
    return {}


def decide(
    table: RoutingTable,
    tenant: TenantPolicy,
    model: str,
    *,
    point: float = 0.0,
    plan: dict[str, tuple[Remote, ...]] | None = None,
) -> Decision:
    """Where the edge of ``table.region`` would send ``tenant``'s request for ``model``.

    ``point``: the request's place in [0, 1) for ramps (``ramp_point`` of its session or
    body); ``plan``: ``spill_plan(table)`` when deciding many requests on one table.
    """
    origin = table.region
    state = TenantState(tenant, origin, tenant_refusals(table, tenant))
    try:
        Admission(origin).policy(state, model)
    except EdgeError as exc:
        return Decision(origin, None, exc.code, exc.status, exc.message)
    remotes = (plan if plan is not None else spill_plan(table)).get(model, ())
    here = local_candidates(table, model)
    cold = not here and any(model in (c.model, *c.adapters) for c in table.cold_models)
    first = first_targets(
        remotes,
        state.allowed,
        local_ok=state.local_allowed,
        here=bool(here),
        cold=cold,
        local_ramp=table.ramp,
        point=point,
    )
    if first is None:
        refused = refusal(
            origin,
            model,
            (tenant.tenant, state.allowed),
            local_ok=state.local_allowed,
            hopped=False,
            served_elsewhere=bool(remotes),
            routed_here=bool(here),
            retry_after_s=0,
        )
        return Decision(origin, None, refused.code, refused.status, refused.message)
    targets, why = first
    if not targets:
        return Decision(origin, origin, "cold" if cold else "local", candidates=here)
    return Decision(origin, targets[0].code, why, fallbacks=tuple(r.code for r in targets[1:]))


def request_point(session: str, prompt: str) -> float:
    """The ramp point of a request: from its session id as the edge computes it; without one
    the edge hashes the whole request body, so the prompt alone gives an indicative point."""
    return ramp_point((session or prompt).encode())
