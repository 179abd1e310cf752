"""Admission at the edge: API key → tenant, key expiry, budget, residency, rate limits. Pure.

Built once per table (:meth:`Admission.load`): a dict from SHA-256 key hash to the tenant's
compiled state, so a request costs one SHA-256 of its key, one dict lookup and two token
buckets. A table without a ``tenants`` section (a hand-written table, file mode only) disables
admission: no authentication at all, as before. Buckets belong to the tenant and survive new
table versions (a limit change re-rates them without refilling them).

Refusals (OpenAI-style, ``docs/edge-federation.md``):

* no or unknown key → 401 ``invalid_api_key``; a key past its ``key_valid_until`` → 401
  ``api_key_expired`` (even while the table naming it is still in use);
* budget ``exhausted`` → **403** ``budget_exhausted`` (not 429: waiting does not help, and the
  OpenAI SDKs retry 429s automatically);
* the model refused to the tenant's residency class → 403 ``model_not_allowed_here`` naming the
  reason (``residency`` or ``unreachable``);
* requests/s or tokens/s over the limit → 429 ``rate_limit_exceeded`` with ``Retry-After``.

Rate limits are shared by the region's edges (``docs/edge-federation.md``, "Rate limits over
several edges"): the table counts the region's live edges (``local_edges``, *n*) and each edge
enforces 1/n of every rate and of its burst (an edge's worker processes count one each, and
never fewer than this edge's own). Behind a balancer that spreads a tenant's requests
evenly, the region admits at most the tenant's limit (plus at most one request per edge when
1/n of the burst is below one request); a tenant whose requests all reach one edge gets 1/n of
its limit, unless the edges share their demand (``peer_load.py``), which sets each edge's part
by where the tenant's requests arrive (:meth:`Admission.reshare`). No state is shared at
request time: a request costs no round trip.

Whether the tenant may be served *in this region* is :attr:`TenantState.local_allowed`; the edge
decides what to do about it (forward to an allowed region, or 403), never serve it here.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from datetime import datetime

from regions.edge.http.errors import EdgeError
from regions.tables.schema import RoutingTable, TableError, TenantPolicy, key_hash

_BEARER = b"bearer "


class TokenBucket:
    """Refills ``rate`` per second up to ``capacity``; a cost above the capacity is admitted from
    a full bucket and leaves it in debt (so a long prompt is slow, not impossible)."""

    __slots__ = ("capacity", "level", "rate", "stamp")

    def __init__(self, rate: float, capacity: float, now: float) -> None:
        self.rate = rate
        self.capacity = capacity
        self.level = capacity
        self.stamp = now

    def rerate(self, rate: float, capacity: float) -> None:
        self.rate = rate
        self.capacity = capacity
        self.level = min(self.level, capacity)

    def wait_for(self, cost: float, now: float) -> float:
        """Seconds until ``cost`` fits (0: it fits now; nothing is taken)."""
        level = min(self.capacity, self.level + (now - self.stamp) * self.rate)
        self.level = level
        self.stamp = now
        need = min(cost, self.capacity)
        return 0.0 if level >= need else (need - level) / self.rate

    def take(self, cost: float) -> None:
        self.level -= cost


class TenantState:
    """What admission knows about one tenant under the current table."""

    __slots__ = (
        "allowed",
        "asked",
        "budget_state",
        "local_allowed",
        "policy",
        "refusals",
        "requests",
        "slug",
        "tokens",
        "valid_until",
    )

    def __init__(self, policy: TenantPolicy, region: str, refusals: dict[str, str]) -> None:
        self.policy = policy
        self.slug = policy.tenant
        self.allowed = frozenset(policy.allowed_regions)
        self.local_allowed = region in self.allowed
        self.budget_state = policy.budget_state
        self.refusals = refusals
        self.valid_until: dict[str, float] = {}
        self.requests: TokenBucket | None = None
        self.tokens: TokenBucket | None = None
        #: Requests that reached the rate limits here, admitted or not (this edge's demand).
        self.asked = 0


def _part(rate: float | None, share: float) -> float | None:
    return None if rate is None else rate * share


def _epoch(text: str) -> float:
    try:
        return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    except ValueError as exc:
        raise TableError(f"key_valid_until {text!r} is not an RFC 3339 time") from exc


def _key_of(header: bytes | None) -> bytes | None:
    if header is None or len(header) <= len(_BEARER) or header[:7].lower() != _BEARER:
        return None
    key = header[7:].strip()
    return key or None


def public_prefix(header: bytes | None) -> str | None:
    """The public part of the key in ``Authorization`` (``fi_AbC123xY``, what key lists
    show), for usage records; None when it is not shaped like a key."""
    key = _key_of(header)
    if key is None or len(key) < PUBLIC_PREFIX_BYTES or key[2:3] != b"_":
        return None
    return key[:PUBLIC_PREFIX_BYTES].decode("ascii", "replace")


#: ``fi_`` and the 8 characters of the key's prefix.
PUBLIC_PREFIX_BYTES = 11

_MISSING = EdgeError(
    401,
    "You didn't provide an API key. Send it as 'Authorization: Bearer fi_...'.",
    "invalid_api_key",
)
_UNKNOWN = EdgeError(401, "Incorrect API key provided.", "invalid_api_key")


class Admission:
    """The admission state of one edge; :meth:`load` on every new table."""

    def __init__(self, region: str, burst_s: float = 2.0, processes: int = 1) -> None:
        self.region = region
        self.burst_s = burst_s
        #: This edge's own worker processes: the least ``local_edges`` can be (a hand-written
        #: table that counts edges, not their workers, still shares the limit among them).
        self.processes = processes
        self.enabled = False
        self.by_hash: dict[str, TenantState] = {}
        self._tenants: dict[str, TenantState] = {}
        #: The region's live edges (the table's ``local_edges``): each has 1/n of every limit,
        #: unless ``shares`` (from the edges' demand, ``peer_load.py``) says otherwise.
        self.local_edges = 1
        self.shares: dict[str, float] = {}
        #: Adapter -> the tenants that may use it (the table's ``private_adapters``).
        self.private_adapters: dict[str, frozenset[str]] = {}

    def load(self, table: RoutingTable, now: float) -> None:
        """Rebuild from ``table`` (``now``: monotonic seconds, for new buckets)."""
        self.private_adapters = {
            name: frozenset(tenants) for name, tenants in table.private_adapters.items()
        }
        if table.tenants is None:
            self.enabled = False
            self.by_hash = {}
            self._tenants = {}
            return
        classes = {c.id: c.refusals for c in table.residency_classes}
        by_hash: dict[str, TenantState] = {}
        tenants: dict[str, TenantState] = {}
        self.local_edges = max(table.local_edges, self.processes)
        for policy in table.tenants:
            state = TenantState(policy, self.region, classes.get(policy.residency_class or "", {}))
            state.valid_until = {h: _epoch(t) for h, t in policy.key_valid_until.items()}
            old = self._tenants.get(policy.tenant)
            if old is not None:
                state.asked = old.asked
            # This edge's part of every limit: 1/n, or what demand gave it (``reshare``).
            share = self.shares.get(policy.tenant, 1.0 / self.local_edges)
            self._rate(state, old, share, now)
            tenants[policy.tenant] = state
            for digest in policy.key_hashes:
                by_hash[digest] = state
        self.by_hash = by_hash
        self._tenants = tenants
        self.enabled = True

    def reshare(self, shares: dict[str, float], now: float) -> None:
        """This edge's part of each tenant's limits (tenant slug → share, ``peer_load.py``);
        a tenant left out gets 1/n again."""
        equal = 1.0 / self.local_edges
        for slug in shares.keys() | self.shares.keys():
            state = self._tenants.get(slug)
            share = shares.get(slug, equal)
            if state is not None and share != self.shares.get(slug, equal):
                self._rate(state, state, share, now)
        self.shares = shares

    def limited(self) -> Iterator[TenantState]:
        """The tenants with a rate limit (those whose share matters)."""
        for state in self._tenants.values():
            if state.requests is not None or state.tokens is not None:
                yield state

    def _rate(self, state: TenantState, old: TenantState | None, share: float, now: float) -> None:
        policy = state.policy
        state.requests = self._bucket(
            old.requests if old else None, _part(policy.requests_per_s, share), 1.0, now
        )
        state.tokens = self._bucket(
            old.tokens if old else None, _part(policy.tokens_per_s, share), 0.0, now
        )

    def _bucket(
        self, old: TokenBucket | None, rate: float | None, floor: float, now: float
    ) -> TokenBucket | None:
        if rate is None:
            return None
        if rate <= 0:
            rate = 1e-9  # a zero limit admits nothing (the wait is effectively forever)
        capacity = max(rate * self.burst_s, floor)
        if old is None:
            return TokenBucket(rate, capacity, now)
        old.wait_for(0.0, now)  # refilled up to now at the old rate, the new one from now on
        old.rerate(rate, capacity)
        return old

    def authenticate(self, header: bytes | None, wall_now: float) -> TenantState:
        """The tenant of ``Authorization: Bearer <key>``, or an :class:`EdgeError` (401)."""
        key = _key_of(header)
        if key is None:
            raise _MISSING
        digest = key_hash(key)
        state = self.by_hash.get(digest)
        if state is None:
            raise _UNKNOWN
        until = state.valid_until.get(digest) if state.valid_until else None
        if until is not None and wall_now >= until:
            raise EdgeError(
                401,
                "This API key has expired; create or rotate a key in the console.",
                "api_key_expired",
            )
        return state

    def check(self, state: TenantState, model: str, cost_tokens: int, now: float) -> None:
        """Budget, model residency and rate limits for one request; raises :class:`EdgeError`.

        ``now`` is monotonic seconds. Nothing is taken from a bucket unless both fit.
        """
        self.policy(state, model)
        self.rate(state, cost_tokens, now)

    def policy(self, state: TenantState, model: str) -> None:
        """Another tenant's private adapter (404, as if it did not exist), budget and the
        table's residency refusal of ``model`` (403s)."""
        owners = self.private_adapters.get(model)
        if owners is not None and state.slug not in owners:
            raise EdgeError(
                404,
                f"The model `{model}` does not exist in region {self.region}.",
                "model_not_found",
                "model",
            )
        if state.budget_state == "exhausted":
            raise EdgeError(
                403,
                f"Tenant {state.slug!r} has exhausted its monthly budget; "
                "raise the budget or wait for the next month.",
                "budget_exhausted",
            )
        if state.refusals:
            reason = state.refusals.get(model)
            if reason is not None:
                raise EdgeError(
                    403,
                    f"The model `{model}` is not available to tenant {state.slug!r} from region "
                    f"{self.region} ({reason}: allowed regions "
                    f"{', '.join(sorted(state.allowed)) or 'none'}).",
                    "model_not_allowed_here",
                    "model",
                )

    def rate(self, state: TenantState, cost_tokens: int, now: float) -> None:
        """Both token buckets, or 429 with ``Retry-After`` (nothing taken then).

        ``cost_tokens`` is what the request can cost (``ParsedRequest.cost_tokens``: prompt
        estimate plus every choice's output limit), so a client cannot buy a thousand-token
        answer at the price of a ten-token prompt; :meth:`settle` gives back what it did not use.
        """
        state.asked += 1
        requests, tokens = state.requests, state.tokens
        wait = requests.wait_for(1.0, now) if requests is not None else 0.0
        if tokens is not None:
            wait = max(wait, tokens.wait_for(float(cost_tokens), now))
        if wait > 0:
            raise EdgeError(
                429,
                f"Rate limit reached for tenant {state.slug!r}; retry in {wait:.2f}s.",
                "rate_limit_exceeded",
                retry_after=max(1, math.ceil(wait)),
            )
        if requests is not None:
            requests.take(1.0)
        if tokens is not None:
            tokens.take(float(cost_tokens))

    @staticmethod
    def settle(state: TenantState, charged: int, used: int) -> None:
        """Reconcile an up-front charge with the engine's usage (prompt + completion tokens):
        the unused part goes back to the bucket (never above its capacity); usage above the
        charge (an estimate that fell short) is taken as debt."""
        tokens = state.tokens
        if tokens is not None:
            tokens.level = min(tokens.capacity, tokens.level + (charged - used))
