"""The routing-table contract (schema 1, or 2 with ramps: ``docs/routing-table.md``).

The one definition both sides share: the control plane's compiler builds these Structs and
encodes them; the edge decodes the same Structs from a file (``--table``) or from the control
plane with its ``signature`` verified (``regions/edge/control/table_sync.py``). Pure: no Django,
no I/O.
Decoding is strict (msgspec Structs, unknown fields refused) and :func:`validate_table` checks
what a type cannot say (unique ids, positive rates, URLs), so a bad table is refused as a
whole and the edge keeps serving from the last good one.
"""

from __future__ import annotations

import hashlib
import re
from datetime import datetime
from typing import Any, Literal
from urllib.parse import urlsplit

import msgspec

SCHEMA_VERSION = 1
#: Schema 2 is schema 1 plus the ``ramp`` fields of a region getting its traffic back.
RAMP_SCHEMA_VERSION = 2
#: Schema 3 is schema 2 plus budget leases (``prices``, ``tenants[].budget``).
BUDGET_SCHEMA_VERSION = 3
#: Schema 4 is schema 3 plus a remote region's other edges (``remote_regions[].edges``).
EDGES_SCHEMA_VERSION = 4
#: Schema 5 is schema 4 plus the models deployed here but scaled to zero (``cold_models``).
COLD_SCHEMA_VERSION = 5
#: Schema 5 also carries ``local_edges``: how many live edges this region runs, so each edge
#: enforces its share of a tenant's rate limit (``regions/edge/policy/admission.py``).
LOCAL_EDGES_SCHEMA_VERSION = COLD_SCHEMA_VERSION
#: Schema 6 is schema 5 plus the adapters only some tenants may use (``private_adapters``).
PRIVATE_ADAPTERS_SCHEMA_VERSION = 6
READABLE_SCHEMA_VERSIONS = (
    SCHEMA_VERSION,
    RAMP_SCHEMA_VERSION,
    BUDGET_SCHEMA_VERSION,
    EDGES_SCHEMA_VERSION,
    COLD_SCHEMA_VERSION,
    PRIVATE_ADAPTERS_SCHEMA_VERSION,
)
#: Longest cold start a table may announce (a day: weights of any size, a slow disk).
MAX_COLD_START_S = 86_400.0
#: Live edges of this region a table may count (each gets 1/n of a tenant's rate limit).
MAX_LOCAL_EDGES = 256
#: Edges of one remote region a table may list (a spilled request may try each of them).
MAX_REMOTE_EDGES = 16
#: Worker processes one edge may run on its port (``fedinfer edge --workers``).
MAX_EDGE_WORKERS = 32
#: Longest registered edge name (the usage records' and the counted spend's ``edge`` column).
MAX_EDGE_NAME = 63


def lease_holder(edge: str, worker: int) -> str:
    """Who an edge's worker process is to the control plane's books: the edge's own name for
    worker 0, ``<name>.<worker>`` for the others. Each holds budget leases of its own and signs
    its usage records with it, and each is one of the region's ``local_edges``; a dot is never
    part of a registered name (a slug), so a holder is never another edge."""
    return edge if worker == 0 else f"{edge}.{worker}"


def lease_holders(edge: str, workers: int) -> list[str]:
    """Every holder of an edge running ``workers`` processes."""
    return [lease_holder(edge, w) for w in range(max(1, min(workers, MAX_EDGE_WORKERS)))]


def holds_for(edge: str, holder: str) -> bool:
    """Whether ``holder`` is ``edge`` or one of its workers (what an edge may sign for)."""
    if holder == edge:
        return True
    name, dot, worker = holder.rpartition(".")
    return (
        bool(dot)
        and name == edge
        and worker.isdigit()
        and worker == str(int(worker))
        and 1 <= int(worker) < MAX_EDGE_WORKERS
    )


Role = Literal["mixed", "prefill", "decode"]
ROLES: tuple[Role, ...] = ("mixed", "prefill", "decode")
BudgetState = Literal["ok", "warn", "exhausted"]
InstanceState = Literal["ready", "starting", "draining", "stopped"]


def key_hash(plaintext: bytes) -> str:
    """SHA-256 hex of a whole API key: what the control plane stores and the table's
    ``key_hashes`` carry, and what the edge looks a presented key up by."""
    return hashlib.sha256(plaintext).hexdigest()


class TableError(ValueError):
    """The document is not a valid routing table (or may not replace the current one)."""


class Instance(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One engine (a vLLM server or a simulator) this region's edges may route to."""

    id: str
    url: str
    model: str
    adapters: tuple[str, ...] = ()
    role: Role = "mixed"
    accelerator: str = "unknown"
    tp: int = 1
    #: Requests the engine runs at once (vLLM ``max_num_seqs``); the edge's per-instance cap.
    max_concurrency: int = 64
    #: Prompt tokens per second this instance prefills (from its accelerator and TP size).
    prefill_tokens_per_s: float = 8000.0
    state: InstanceState = "ready"
    #: Engine-side KV block size in tokens (informational, for KV-event hashes).
    kv_block_tokens: int = 16
    #: ZMQ endpoint of vLLM KV-cache events, when the engine publishes them.
    kv_events_endpoint: str | None = None
    #: Tokens/s it sustains at the target utilisation, and its share of that among the
    #: region's instances of the same model and role (from the compiler).
    capacity_tokens_per_s: float = 0.0
    weight: float = 0.0


class RemoteRegion(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Another region's edge that may take spill-over or failover traffic."""

    code: str
    edge_url: str
    rtt_ms: float
    models: tuple[str, ...] = ()
    cost_per_mtok: float = 0.0
    headroom: float = 0.0
    #: Share of the traffic that would go there it takes while it comes back (schema 2).
    ramp: float = 1.0
    #: That region's other live edges (schema 4): a spilled request goes to one of them or
    #: ``edge_url``, and to the next before its first byte if that one fails.
    edges: tuple[str, ...] = ()


class RouteTarget(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A remote region's offer for one model, as seen from this region."""

    code: str
    #: Share of this region's expected demand for the model the demand split sends there.
    weight: float = 0.0
    rtt_ms: float = 0.0
    cost_per_mtok: float = 0.0
    #: Capacity at the target utilisation minus the split's expected load there.
    headroom_tokens_per_s: float = 0.0
    headroom: float = 0.0


class ColdModel(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A model deployed in this region with no ready instance (scaled to zero): known and
    allowed, so the edge holds its first requests while a replica warms instead of a 404."""

    model: str
    #: Adapters of its deployment, which wake it too.
    adapters: tuple[str, ...] = ()
    #: Seconds a replica took to become ready at its last cold start (else the control
    #: plane's default): how long an edge may hold a request for it (within its own maximum).
    cold_start_s: float = 60.0


class ModelRoute(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Where this region's traffic for one model (or adapter) goes."""

    model: str
    demand_tokens_per_s: float = 0.0
    local_weight: float = 0.0
    #: Expected demand no allowed region can take within capacity.
    unserved_tokens_per_s: float = 0.0
    local_capacity_tokens_per_s: float = 0.0
    local_headroom_tokens_per_s: float = 0.0
    local_cost_per_mtok: float = 0.0
    #: Spill-over order: regions with headroom first, cheapest after the latency penalty.
    remotes: tuple[RouteTarget, ...] = ()


class ResidencyClass(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Tenants allowed the same regions; ``refusals``: model -> why it is refused here."""

    id: str
    allowed_regions: tuple[str, ...] = ()
    refusals: dict[str, str] = msgspec.field(default_factory=dict)


class ModelPrice(msgspec.Struct, frozen=True, forbid_unknown_fields=True, array_like=True):
    """Micro-USD per million tokens: fresh prompt, cached prompt, generated (exact integers:
    a request's price is then an exact integer of pico-USD, ``regions/tables/money.py``)."""

    input: int
    cached_input: int
    output: int


class Lease(msgspec.Struct, frozen=True, forbid_unknown_fields=True, array_like=True):
    """One edge's share of a budget, pico-USD (``docs/adr/0008-budget-leases.md``).

    ``counted``: what the control plane has counted of this month's spend served by that edge;
    ``lease``: what the edge may commit beyond it — settled requests not yet counted, plus the
    worst case of those in flight — until the next table (its ceiling is the sum).
    ``prior``: the control plane's own record of the highest ceiling the edge may still be
    spending under from an earlier table (the edge does not read it)."""

    counted: int
    lease: int
    prior: int = 0


class Budget(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A monthly budget enforced at the edges (schema 3), for a tenant or one of its keys."""

    #: The UTC month the amounts are of, ``YYYY-MM``.
    month: str
    #: ``exhausted``: nothing remains (every edge refuses); ``warn``: 80 % spent.
    state: BudgetState = "ok"
    #: Edge name -> its lease. An edge without one serves none of this budget's requests
    #: (it may still forward them to an edge that has one).
    leases: dict[str, Lease] = msgspec.field(default_factory=dict)


class TenantBudget(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A tenant's budget leases (None: only some of its keys have a budget), its own prices
    where they differ from the table's list prices, and the leases of its keys that have a
    budget of their own (by the key's public prefix, ``fi_AbC123xY``)."""

    tenant: Budget | None = None
    prices: dict[str, ModelPrice] = msgspec.field(default_factory=dict)
    keys: dict[str, Budget] = msgspec.field(default_factory=dict)

    def scopes(self) -> list[tuple[str, Budget]]:
        """Every budget with its key prefix, ``""`` for the tenant's own."""
        found = list(self.keys.items())
        if self.tenant is not None:
            found.append(("", self.tenant))
        return found


class TenantPolicy(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A tenant's admission rules, keyed by API-key hash (enforced by admission.py)."""

    tenant: str
    key_hashes: tuple[str, ...] = ()
    allowed_regions: tuple[str, ...] = ()
    requests_per_s: float | None = None
    tokens_per_s: float | None = None
    budget_state: BudgetState = "ok"
    #: Key hash -> RFC 3339 UTC time the edge stops accepting it (absent: no expiry).
    key_valid_until: dict[str, str] = msgspec.field(default_factory=dict)
    #: Id of its entry in ``residency_classes`` (refusals live there, once per class).
    residency_class: str | None = None
    #: Set when the tenant's KV cache is isolated: the edge sends this secret as vLLM's
    #: ``cache_salt`` with every request (joined with the client's own salt, if any), so no
    #: other tenant can hit — or time — its cached prefixes. Absent: caches are shared.
    cache_salt: str | None = None
    #: Set when the tenant (or one of its keys) has a monthly budget (schema 3).
    budget: TenantBudget | None = None


class Signature(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """HMAC over the canonical document (verified by regions/tables/signing.py)."""

    alg: str
    key_id: str
    value: str


class RoutingTable(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    schema_version: int
    version: int
    region: str
    generated_at: str
    instances: tuple[Instance, ...] = ()
    remote_regions: tuple[RemoteRegion, ...] = ()
    tenants: tuple[TenantPolicy, ...] | None = None
    signature: Signature | None = None
    routes: tuple[ModelRoute, ...] = ()
    residency_classes: tuple[ResidencyClass, ...] = ()
    #: Share of this region's own traffic it serves while it comes back (schema 2).
    ramp: float = 1.0
    #: List prices by model (schema 3), what budgets are spent at unless a tenant's own differ.
    prices: dict[str, ModelPrice] = msgspec.field(default_factory=dict)
    #: Models deployed here and scaled to zero (schema 5), sorted by model.
    cold_models: tuple[ColdModel, ...] = ()
    #: This region's live edges (schema 5; 1 when absent): each enforces 1/n of every rate
    #: limit, so n edges behind a balancer admit a tenant's limit, not n times it.
    local_edges: int = 1
    #: Adapter name -> the only tenants (slugs, sorted) that may use it (schema 6). An adapter
    #: not listed is public; to any other tenant a listed one does not exist (404).
    private_adapters: dict[str, tuple[str, ...]] = msgspec.field(default_factory=dict)


_decoder = msgspec.json.Decoder(RoutingTable)


def decode_table(data: bytes) -> RoutingTable:
    """Decode and validate a table document; raise :class:`TableError` on any defect."""
    try:
        table = _decoder.decode(data)
    except msgspec.DecodeError as exc:
        raise TableError(f"routing table does not decode: {exc}") from exc
    validate_table(table)
    return table


def encode_table(
    table: RoutingTable, *, encoded_tenants: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    """The JSON-ready document of ``table``: what is signed, stored and served.

    Every field is written, defaults included, so the document says all the edge will use —
    except a ``ramp`` of 1, which is left out: a table without a ramp in progress stays a
    schema-1 document that an edge reading only schema 1 accepts. ``encoded_tenants`` is
    ``table.tenants`` already encoded (:func:`encode_tenants`): every region's table carries
    the same tenant list, so the compiler encodes it once for all of them.
    """
    if encoded_tenants is not None:
        table = msgspec.structs.replace(table, tenants=None)
    document: dict[str, Any] = msgspec.json.decode(msgspec.json.encode(table))  # plain JSON
    if encoded_tenants is not None:
        document["tenants"] = encoded_tenants
    if table.ramp == 1.0:
        del document["ramp"]
    if not table.prices:
        del document["prices"]
    if not table.cold_models:
        del document["cold_models"]  # nothing cold: readable by schema-4 edges
    if table.local_edges == 1:
        del document["local_edges"]  # one edge: readable by schema-4 edges
    if not table.private_adapters:
        del document["private_adapters"]  # every adapter public: readable by schema-5 edges
    for remote in document["remote_regions"]:
        if remote["ramp"] == 1.0:
            del remote["ramp"]
        if not remote["edges"]:
            del remote["edges"]  # one edge per region: readable by schema-3 edges
    return document


def encode_tenants(tenants: tuple[TenantPolicy, ...]) -> list[dict[str, Any]]:
    """``tenants`` as the document's ``tenants`` list (see :func:`encode_table`)."""
    encoded: list[dict[str, Any]] = msgspec.json.decode(msgspec.json.encode(tenants))
    for tenant in encoded:
        if tenant["budget"] is None:
            del tenant["budget"]  # a table without budgets stays readable by schema-2 edges
    return encoded


def validate_table(table: RoutingTable) -> None:
    """Checks a type cannot express; the first defect is raised as :class:`TableError`."""
    if table.schema_version not in READABLE_SCHEMA_VERSIONS:
        readable = ", ".join(map(str, READABLE_SCHEMA_VERSIONS))
        raise TableError(
            f"unsupported schema_version {table.schema_version} (this edge reads {readable})"
        )
    if table.version < 1:
        raise TableError("version must be a positive integer")
    if not table.region:
        raise TableError("region must not be empty")
    _validate_ramps(table)
    _validate_local_edges(table)
    seen: set[str] = set()
    for inst in table.instances:
        if inst.id in seen:
            raise TableError(f"duplicate instance id {inst.id!r}")
        seen.add(inst.id)
        _validate_instance(inst)
    for tenant in table.tenants or ():
        _validate_tenant(tenant)
        if tenant.budget is not None:
            _validate_budget(table, tenant.tenant, tenant.budget)
    for model, price in table.prices.items():
        _validate_price(f"prices[{model!r}]", price, table.schema_version)
    _validate_cold(table)
    _validate_private_adapters(table)
    codes: set[str] = set()
    for remote in table.remote_regions:
        if remote.code == table.region or remote.code in codes:
            raise TableError(f"remote region {remote.code!r} duplicated or equal to own region")
        codes.add(remote.code)
        _validate_remote(remote, table.schema_version)


def _validate_cold(table: RoutingTable) -> None:
    if not table.cold_models:
        return
    if table.schema_version < COLD_SCHEMA_VERSION:
        raise TableError(f"cold_models need schema_version {COLD_SCHEMA_VERSION}")
    local = {n for i in table.instances for n in (i.model, *i.adapters)}
    seen: set[str] = set()
    for cold in table.cold_models:
        where = f"cold model {cold.model!r}"
        if not cold.model:
            raise TableError("cold model names must not be empty")
        for name in (cold.model, *cold.adapters):
            if name in seen or name in local:
                raise TableError(f"{where}: {name!r} is listed twice or has an instance here")
            seen.add(name)
        if not 0 < cold.cold_start_s <= MAX_COLD_START_S:
            raise TableError(f"{where}: cold_start_s must be within (0, {MAX_COLD_START_S:g}]")


def _validate_private_adapters(table: RoutingTable) -> None:
    if not table.private_adapters:
        return
    if table.schema_version < PRIVATE_ADAPTERS_SCHEMA_VERSION:
        raise TableError(f"private_adapters need schema_version {PRIVATE_ADAPTERS_SCHEMA_VERSION}")
    if table.tenants is None:
        # Without admission no request has a tenant: a private adapter would be everyone's.
        raise TableError("private_adapters need a tenants section (admission)")
    for name, tenants in table.private_adapters.items():
        if not name or not tenants or any(not t for t in tenants):
            raise TableError(f"private adapter {name!r}: a name and at least one tenant")


def _validate_ramps(table: RoutingTable) -> None:
    ramps = [("ramp", table.ramp)] + [(f"{r.code}.ramp", r.ramp) for r in table.remote_regions]
    for name, ramp in ramps:
        if not 0.0 <= ramp <= 1.0:
            raise TableError(f"{name} must be within [0, 1], got {ramp}")
        if ramp != 1.0 and table.schema_version < RAMP_SCHEMA_VERSION:
            raise TableError(f"{name} needs schema_version {RAMP_SCHEMA_VERSION}")


def _validate_instance(inst: Instance) -> None:
    if not inst.id:
        raise TableError("instance id must not be empty")
    where = f"instance {inst.id!r}"
    defect = _origin_defect(inst.url)
    if defect:
        raise TableError(f"{where}: url {inst.url!r} {defect}")
    if not inst.model:
        raise TableError(f"{where}: model must not be empty")
    at_least_one = {
        "tp": inst.tp,
        "max_concurrency": inst.max_concurrency,
        "kv_block_tokens": inst.kv_block_tokens,
    }
    for name, value in at_least_one.items():
        if value < 1:
            raise TableError(f"{where}: {name} must be >= 1")
    if not inst.prefill_tokens_per_s > 0:
        raise TableError(f"{where}: prefill_tokens_per_s must be > 0")


def _validate_tenant(tenant: TenantPolicy) -> None:
    for digest, until in tenant.key_valid_until.items():
        try:
            datetime.fromisoformat(until.replace("Z", "+00:00"))
        except ValueError:
            raise TableError(
                f"tenant {tenant.tenant!r}: key_valid_until of {digest[:12]}... "
                f"is not an RFC 3339 time: {until!r}"
            ) from None
    for rate in (tenant.requests_per_s, tenant.tokens_per_s):
        if rate is not None and rate < 0:
            raise TableError(f"tenant {tenant.tenant!r}: rate limits must be >= 0")


def _validate_budget(table: RoutingTable, tenant: str, budget: TenantBudget) -> None:
    where = f"tenant {tenant!r}: budget"
    if table.schema_version < BUDGET_SCHEMA_VERSION:
        raise TableError(f"{where} needs schema_version {BUDGET_SCHEMA_VERSION}")
    for model, price in budget.prices.items():
        _validate_price(f"{where} prices[{model!r}]", price, table.schema_version)
    for key, leases in budget.scopes():
        scope = f" key {key!r}" if key else ""
        if not _MONTH.fullmatch(leases.month):
            raise TableError(f"{where}{scope}: month {leases.month!r} is not YYYY-MM")
        for edge, lease in leases.leases.items():
            if min(lease.counted, lease.lease, lease.prior) < 0:
                raise TableError(f"{where}{scope}: the lease of edge {edge!r} is negative")


def _validate_price(where: str, price: ModelPrice, schema_version: int) -> None:
    if schema_version < BUDGET_SCHEMA_VERSION:
        raise TableError(f"{where} needs schema_version {BUDGET_SCHEMA_VERSION}")
    if min(price.input, price.cached_input, price.output) < 0:
        raise TableError(f"{where} must not be negative")


_MONTH = re.compile(r"\d{4}-(0[1-9]|1[0-2])")


def _validate_remote(remote: RemoteRegion, schema_version: int) -> None:
    where = f"remote region {remote.code!r}"
    for field, url in [("edge_url", remote.edge_url), *(("edges", e) for e in remote.edges)]:
        defect = _origin_defect(url)
        if defect:
            raise TableError(f"{where}: {field} {url!r} {defect}")
    if remote.rtt_ms < 0:
        raise TableError(f"{where}: rtt_ms must be >= 0")
    if remote.edges:
        if schema_version < EDGES_SCHEMA_VERSION:
            raise TableError(f"{where}: edges need schema_version {EDGES_SCHEMA_VERSION}")
        if len(remote.edges) >= MAX_REMOTE_EDGES:
            raise TableError(f"{where}: at most {MAX_REMOTE_EDGES} edges")
        if len({remote.edge_url, *remote.edges}) != 1 + len(remote.edges):
            raise TableError(f"{where}: an edge is listed twice")


#: A DNS name or IPv4 address (underscores allowed: container names), or an IPv6 address.
_HOST = re.compile(r"[a-z0-9._-]+|[0-9a-f:.]+")


def _validate_local_edges(table: RoutingTable) -> None:
    if table.local_edges != 1:
        if table.schema_version < LOCAL_EDGES_SCHEMA_VERSION:
            raise TableError(f"local_edges needs schema_version {LOCAL_EDGES_SCHEMA_VERSION}")
        if not 1 <= table.local_edges <= MAX_LOCAL_EDGES:
            raise TableError(f"local_edges must be within 1-{MAX_LOCAL_EDGES}")


def _origin_defect(url: str) -> str:
    """Why ``url`` is not an ``http(s)://host[:port][/]`` origin ("" when it is one).

    The edge appends its own paths to the origin, so a path, query or credentials would be
    silently dropped (or break each request): refused with the table instead.
    """
    try:
        parts = urlsplit(url)
    except ValueError as exc:  # a bad [IPv6] literal
        return f"does not parse: {exc}"
    try:
        port = parts.port
    except ValueError:  # out of range, or not a number
        port = 0
    if parts.scheme not in ("http", "https"):
        return "scheme must be http or https"
    host = parts.hostname
    if not host:
        return "has no host"
    if not _HOST.fullmatch(host):
        return "host must be a DNS name or IP address (ASCII: punycode for IDN)"
    if port == 0:
        return "port must be a number within 1-65535"
    if "@" in parts.netloc:
        return "must not carry userinfo"
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        return "must not have a path, query or fragment"
    return ""


def check_successor(current: RoutingTable | None, new: RoutingTable, *, region: str) -> None:
    """Refuse a table for another region or one whose version does not move forward."""
    if new.region != region:
        raise TableError(f"table is for region {new.region!r}, this edge serves {region!r}")
    if current is not None and new.version <= current.version:
        raise TableError(
            f"table version {new.version} does not advance the current {current.version}"
        )


def served_models(table: RoutingTable) -> tuple[str, ...]:
    """Model and adapter names with at least one instance not stopped, sorted."""
    names: set[str] = set()
    for inst in table.instances:
        if inst.state != "stopped":
            names.add(inst.model)
            names.update(inst.adapters)
    return tuple(sorted(names))
