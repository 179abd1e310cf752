"""The tenants' part of every region's table: residency classes and tenant entries. Pure.

Tenants whose policies allow the same regions form one residency class (one commodity of the
demand split, ``demand.py``); each tenant's entry carries its keys, limits, allowed regions and
budget lease. What is the same for a whole class is computed once per class, and a plan built
from equal inputs is reused whole (the console's previews compile the fleet twice).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from federation.routing import leases
from federation.routing.digest import section_digest
from federation.routing.leases import tenant_budget
from federation.routing.snapshot import INFERENCE_SCOPE, FleetSnapshot, RegionRow, TenantRow
from federation.tenancy.residency import ResidencyPolicy, region_allowed
from regions.tables import schema


def _r(value: float, digits: int = 4) -> float:
    return round(value, digits) + 0.0  # + 0.0 turns -0.0 into 0.0 (stable bytes)


@dataclass(frozen=True, slots=True)
class ResidencyClass:
    """Tenants whose policies allow the same regions: one commodity of the demand split."""

    id: str
    allowed: frozenset[str]
    tenants: int


@dataclass(slots=True)
class TenantPlan:
    """The tenants' part of a plan, and the inputs it was computed from. Its entries as the
    documents carry them, and their digest, are computed once however many regions' tables
    and compiles share the plan: at 100,000 tenants they are most of every table."""

    inputs: tuple[Any, ...]
    classes: list[ResidencyClass]
    entries: tuple[schema.TenantPolicy, ...]
    _documents: list[dict[str, Any]] | None = field(default=None, compare=False, repr=False)
    _digest: str | None = field(default=None, compare=False, repr=False)

    def documents(self) -> list[dict[str, Any]]:
        """The entries as every table's ``tenants`` list (:func:`schema.encode_tenants`)."""
        if self._documents is None:
            self._documents = schema.encode_tenants(self.entries)
        return self._documents

    def digest(self) -> str:
        """SHA-256 of :meth:`documents` as canonical JSON (``tables_digest.section_digest``)."""
        if self._digest is None:
            self._digest = section_digest(self.documents())
        return self._digest


def budget_state(*, monthly_budget_usd: float | None, spend_usd: float) -> schema.BudgetState:
    """The tenant's ``budget_state`` (:func:`federation.routing.leases.budget_state`); ``ok``
    without a budget."""
    if monthly_budget_usd is None:
        return "ok"
    return leases.budget_state(monthly_budget_usd, spend_usd)


def _rfc3339(moment: datetime) -> str:
    # Rounded down to the second: the edge stops accepting a key no later than it should.
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def class_id(allowed: frozenset[str]) -> str:
    """Stable across compiles: derived from the allowed regions only."""
    return "rc-" + hashlib.sha256(",".join(sorted(allowed)).encode()).hexdigest()[:12]


def tenant_entry(
    tenant: TenantRow, allowed: tuple[str, ...], class_id: str, edges: Sequence[str]
) -> schema.TenantPolicy:
    """``allowed``: its regions, sorted; ``edges``: the live edges of the active ones (its
    budgets' leases). Both are its residency class's, computed once per class."""
    keys = sorted((k for k in tenant.keys if INFERENCE_SCOPE in k.scopes), key=lambda k: k.key_hash)
    return schema.TenantPolicy(
        tenant=tenant.slug,
        key_hashes=tuple(k.key_hash for k in keys),
        key_valid_until={
            k.key_hash: _rfc3339(k.valid_until) for k in keys if k.valid_until is not None
        },
        allowed_regions=allowed,
        residency_class=class_id,
        requests_per_s=None
        if tenant.requests_per_minute is None
        else _r(tenant.requests_per_minute / 60.0),
        tokens_per_s=None
        if tenant.tokens_per_minute is None
        else _r(tenant.tokens_per_minute / 60.0),
        budget_state=budget_state(
            monthly_budget_usd=tenant.monthly_budget_usd, spend_usd=tenant.spend_usd
        ),
        cache_salt=tenant.cache_salt,
        budget=None if tenant.budget is None else tenant_budget(tenant.budget, edges),
    )


def tenant_inputs(
    snapshot: FleetSnapshot, regions: Mapping[str, RegionRow], active: set[str]
) -> tuple[Any, ...]:
    """What the tenants' part of a plan depends on: the tenants, where the regions are, and
    — when some tenant has a budget, whose leases they are — the live edges of the active
    regions."""
    budgeted = any(t.budget is not None for t in snapshot.tenants)
    return (
        snapshot.tenants,
        tuple((c, r.jurisdiction) for c, r in regions.items()),
        tuple((c, regions[c].edges) for c in sorted(active)) if budgeted else None,
    )


def plan_tenants(
    snapshot: FleetSnapshot,
    regions: Mapping[str, RegionRow],
    active: set[str],
    *,
    reuse: TenantPlan | None,
) -> TenantPlan:
    """Residency classes (tenants grouped by the regions they may be served in) and the
    tenant entries; ``reuse``'s when it was computed from the same inputs. What is the same
    for a whole class — its regions, id, leased edges — is computed once per distinct
    policy or class, not once per tenant."""
    inputs = tenant_inputs(snapshot, regions, active)
    if reuse is not None and reuse.inputs == inputs:
        return reuse
    jurisdiction = {c: r.jurisdiction for c, r in regions.items()}
    allowed_by_policy: dict[ResidencyPolicy, frozenset[str]] = {}
    by_allowed: dict[frozenset[str], list[TenantRow]] = {}
    for tenant in snapshot.tenants:
        allowed = allowed_by_policy.get(tenant.policy)
        if allowed is None:
            allowed = allowed_by_policy[tenant.policy] = frozenset(
                c for c in regions if region_allowed(tenant.policy, c, jurisdiction[c])
            )
        by_allowed.setdefault(allowed, []).append(tenant)
    ids = {a: class_id(a) for a in by_allowed}
    classes = sorted(
        (ResidencyClass(ids[a], a, len(t)) for a, t in by_allowed.items()), key=lambda c: c.id
    )
    entries: list[schema.TenantPolicy] = []
    for allowed, group in by_allowed.items():
        regions_of = tuple(sorted(allowed))
        # Budgets are leased to the live edges of the active regions a tenant may be served in.
        edges = [e for c in sorted(allowed & active) for e in regions[c].edges]
        entries.extend(tenant_entry(t, regions_of, ids[allowed], edges) for t in group)
    entries.sort(key=lambda e: e.tenant)
    return TenantPlan(inputs, classes, tuple(entries))
