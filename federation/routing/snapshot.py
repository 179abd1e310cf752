"""What the routing compiler reads: a snapshot of the fleet as plain rows. Pure: no Django.

``federation.routing.selectors`` builds a :class:`FleetSnapshot` from the database;
``compiler.py`` turns it into every region's table. Kept apart so that both sides, the console's
previews and the tests can build snapshots without the compiler's internals.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING

from federation.routing.leases import BudgetRow
from federation.tenancy.residency import ResidencyPolicy
from regions.tables import schema

if TYPE_CHECKING:
    from federation.routing.compiler import FleetPlan

#: Only keys with this scope are published: the edge serves inference and nothing else.
INFERENCE_SCOPE = "inference"


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
    #: Price of one GPU of the instance's pool, USD per hour.
    price_per_gpu_hour: float = 0.0
    #: Tokens/s the instance served at its last load snapshot (edge heartbeat), if known.
    load_tokens_per_s: float | None = None
    #: Health as the region's edges report it (a fresh heartbeat); None when nobody reported.
    healthy: bool | None = None


@dataclass(frozen=True, slots=True)
class RegionRow:
    code: str
    status: str
    jurisdiction: str
    edge_url: str | None = None
    #: Its other edges with a fresh heartbeat (or none yet): spill-over's alternatives.
    other_edge_urls: tuple[str, ...] = ()
    #: When it was last restored from an evacuation, and when its instances last came back
    #: after all were reported unhealthy: its traffic ramps back from the later of the two.
    restored_at: datetime | None = None
    recovered_at: datetime | None = None
    #: Its edges with a fresh heartbeat, one name per worker process (``lease_holders``): the
    #: ones budgets are leased to, and how many share a tenant's rate limit.
    edges: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class KeyRow:
    """One API-key hash the edge accepts (the current secret or a rotated-out one in grace)."""

    key_hash: str
    valid_until: datetime | None = None
    scopes: tuple[str, ...] = (INFERENCE_SCOPE,)


@dataclass(frozen=True, slots=True)
class TenantRow:
    slug: str
    policy: ResidencyPolicy = field(default_factory=ResidencyPolicy)
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    monthly_budget_usd: float | None = None
    #: Spend this month, USD. There is no metering yet: callers pass 0 until there is.
    spend_usd: float = 0.0
    keys: tuple[KeyRow, ...] = ()
    #: The secret vLLM ``cache_salt`` of a tenant whose KV cache is isolated (None: shared).
    cache_salt: str | None = None
    #: Its monthly budgets (tenant's, keys') with the spend counted against them, exactly.
    budget: BudgetRow | None = None


@dataclass(frozen=True, slots=True)
class ColdRow:
    """A deployment that may scale to zero and has no ready instance now: its model is listed
    as cold in its region's table (the edges hold its first requests while a replica warms)."""

    region: str
    model: str
    adapters: tuple[str, ...] = ()
    #: Seconds its last replica took from creation to ready (else the configured default).
    cold_start_s: float = 60.0


@dataclass(frozen=True, slots=True)
class RampPolicy:
    """How a returning region gets its traffic back: ``steps`` levels, each held
    ``window_s / steps`` seconds (1/(steps+1), 2/(steps+1), ...), then all of it. Stepped, not
    continuous, so a ramp publishes ``steps`` table versions rather than one per compile."""

    window_s: float = 60.0
    steps: int = 4


@dataclass(frozen=True, slots=True)
class FleetSnapshot:
    regions: tuple[RegionRow, ...]
    instances: tuple[InstanceRow, ...]
    #: (source, target) -> round-trip milliseconds (measured preferred over configured).
    rtt_ms: dict[tuple[str, str], float] = field(default_factory=dict)
    tenants: tuple[TenantRow, ...] = ()
    #: Expected demand per (origin region, served model), tokens/s. When empty, each region's
    #: demand is what its ready instances served at their last load snapshot.
    demand_tokens_per_s: dict[tuple[str, str], float] = field(default_factory=dict)
    #: The snapshot's time; without it no region ramps (every ramp is taken as complete).
    now: datetime | None = None
    ramp: RampPolicy = field(default_factory=RampPolicy)
    #: List prices by model, for the budgets the edges enforce (schema 3).
    prices: Mapping[str, schema.ModelPrice] = field(default_factory=dict)
    #: Deployments scaled to zero (no ready instance), listed as cold models (schema 5).
    cold: tuple[ColdRow, ...] = ()
    #: (region, adapter): registered LoRA adapters the worker can load onto ready replicas of
    #: their base model there (a provisioned mixed deployment); one not loaded there is a cold
    #: model of the region (loaded where its demand appears), expected to take ``adapter_load_s``.
    loadable_adapters: tuple[tuple[str, str], ...] = ()
    adapter_load_s: float = 30.0
    #: Adapter -> the tenants (slugs) that may use it, for adapters owned by a tenant (an
    #: adapter not listed is public): the tables' ``private_adapters`` (schema 6).
    private_adapters: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    #: Adapter -> its base model, for pricing: an adapter costs what its base model does,
    #: also where it is cold (no instance names its base yet). Loaded when budgets are on.
    adapter_bases: Mapping[str, str] = field(default_factory=dict)
    #: Memo of :func:`fleet_plan` by latency penalty, so that compiling region after region
    #: of one snapshot solves the demand split once (a snapshot is not changed once built).
    plans: dict[float, FleetPlan] = field(default_factory=dict, compare=False, repr=False)
