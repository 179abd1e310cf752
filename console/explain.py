"""Where an edge would send one request, and why: the edge's own pure pieces (admission's
policy check, the spill-over plan, ramps) applied to a routing table, with no edge process.

What only a running edge knows — live queue lengths, which engine caches the prompt's prefix,
where a session is pinned — is not here: inside the chosen region the edge picks the instance
with the lowest expected TTFT (``docs/edge-scheduling.md``); this says which region and why.
"""

from __future__ import annotations

from dataclasses import dataclass

from regions.edge.http.errors import EdgeError
from regions.edge.policy.admission import Admission, TenantState
from regions.edge.policy.spill import (
    Remote,
    eligible_remotes,
    ramp_point,
    returning_remotes,
    spill_plan,
)
from regions.tables.schema import Instance, RoutingTable, TenantPolicy

#: Why a request is served where it is (the edge's ``Spill.why`` and its local case).
REASONS = {
    "local": "served in the region of the edge it reached",
    "residency": "the tenant may not be served in this region: forwarded to an allowed one",
    "not_local": "this region does not serve the model: forwarded",
    "ramp": "this region is coming back (ramping): the request's point is above its share",
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
    allowed = state.allowed
    if state.local_allowed and here:
        if table.ramp < 1.0:
            back = returning_remotes(remotes, allowed, point, table.ramp)
            if back:
                return Decision(
                    origin, back[0].code, "ramp", fallbacks=tuple(r.code for r in back[1:])
                )
        return Decision(origin, origin, "local", candidates=here)
    targets = eligible_remotes(remotes, allowed, None, 0.0, point)
    if not targets:
        return _nowhere(origin, tenant, model, state.local_allowed, bool(remotes))
    return Decision(
        origin,
        targets[0].code,
        "residency" if here else "not_local",
        fallbacks=tuple(r.code for r in targets[1:]),
    )


def _nowhere(
    origin: str, tenant: TenantPolicy, model: str, local_ok: bool, elsewhere: bool
) -> Decision:
    """The edge's refusal when neither its region nor an allowed remote can take the request
    (``regions.edge.stages.admit``: the same statuses and codes)."""
    if not local_ok:
        allowed = ", ".join(sorted(tenant.allowed_regions)) or "none"
        return Decision(
            origin,
            None,
            "region_not_allowed",
            403,
            f"Tenant {tenant.tenant!r} may not be served in region {origin}, and no region it "
            f"allows ({allowed}) can take `{model}` from here.",
        )
    if elsewhere:
        return Decision(
            origin,
            None,
            "no_allowed_region",
            503,
            f"No region this tenant may use can serve `{model}` from {origin} now.",
        )
    return Decision(
        origin, None, "model_not_found", 404, f"The model `{model}` does not exist in {origin}."
    )


def request_point(session: str, prompt: str) -> float:
    """The ramp point of a request: from its session id as the edge computes it; without one
    the edge hashes the whole request body, so the prompt alone gives an indicative point."""
    return ramp_point((session or prompt).encode())
