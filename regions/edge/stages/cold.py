"""Cold models: deployed in this region but scaled to zero (the table's ``cold_models``).

A request for one is known and allowed (not a 404): when no other region may take it, the edge
holds it here while the control plane starts a replica — the heartbeat reports what it holds,
which wakes the deployment at once — and releases the held requests in arrival order when a
table lists a ready instance of the model. Every bound is the edge's own, whatever the table
or the clients say:

* at most ``max_held`` requests held per model (more: 503 ``model_cold`` at once), shared
  fairly by the tenants waiting (:func:`make_room`): one tenant alone may fill the line, but
  once others wait it keeps no more than its share, so its flood never refuses them;
* each held at most the model's expected cold start (the table's ``cold_start_s``, the
  replica's own start, plus ``margin_s`` for the way there and back: heartbeat, autoscale
  pass, table) and never longer than ``max_hold_s`` (then 503 ``model_cold``);
* the ``Retry-After`` of a refusal is the time the replica is still expected to take.

A client that disconnects while held leaves the line (its request's task is cancelled). Held
requests were admitted like any other: charged to the tenant's rate, their price held on its
budget.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import Callable, Container, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from regions.edge.http.errors import EdgeError
from regions.tables.schema import ColdModel, RoutingTable

if TYPE_CHECKING:
    from prometheus_client import Counter

    from regions.edge.stages.context import RequestContext
    from regions.edge.stages.relay import Relay

#: Longest Retry-After a refusal names (an hour: a client should ask again, not give up).
MAX_RETRY_AFTER_S = 3600


@dataclass(frozen=True, slots=True)
class ColdConfig:
    #: Requests held per cold model at once; more are refused with 503 at once.
    max_held: int = 64
    #: Longest a request is held, whatever cold start the table announces.
    max_hold_s: float = 120.0
    #: Added to the table's cold start (a replica's creation to ready): the heartbeat that
    #: wakes it, the autoscale and reconcile passes, the table that lists it.
    margin_s: float = 10.0


class Released(Exception):
    """The model left the table while its requests were held (its deployment went away)."""


def make_room(held_by_tenant: Mapping[str, int], tenant: str, capacity: int) -> str | None:
    """A full line of ``capacity`` and a request of ``tenant``: the tenant whose newest held
    request gives way to it, or None when it is refused instead.

    Max-min fairness without idle places: each tenant waiting (the newcomer included) is owed
    ``max(1, capacity // tenants)`` places. A newcomer below its share takes the newest place
    of the tenant holding the most, if that one holds more than its share; otherwise (it has
    its share already, or nobody holds more than theirs) it is refused. So a tenant alone may
    fill the line, and a flood shrinks to its share as others arrive, never refusing them —
    the newest of the flood gives way, having waited least. O(tenants waiting)."""
    tenants = len(held_by_tenant) + (tenant not in held_by_tenant)
    share = max(1, capacity // tenants)
    if held_by_tenant.get(tenant, 0) >= share:
        return None
    most, count = max(held_by_tenant.items(), key=lambda item: (item[1], item[0]), default=("", 0))
    return most if count > share else None


class _Line:
    """The requests held for one model, in arrival order, and each one's tenant."""

    __slots__ = ("by_tenant", "tenant_of", "waiters")

    def __init__(self) -> None:
        #: True: served here; False: the model left the table; None: gave way to a tenant
        #: below its share.
        self.waiters: deque[asyncio.Future[bool | None]] = deque()
        self.tenant_of: dict[asyncio.Future[bool | None], str] = {}
        self.by_tenant: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self.waiters)

    def add(self, waiter: asyncio.Future[bool | None], tenant: str) -> None:
        self.waiters.append(waiter)
        self.tenant_of[waiter] = tenant
        self.by_tenant[tenant] = self.by_tenant.get(tenant, 0) + 1

    def remove(self, waiter: asyncio.Future[bool | None]) -> None:
        tenant = self.tenant_of.pop(waiter, None)
        if tenant is None:
            return
        self.waiters.remove(waiter)
        if self.by_tenant[tenant] == 1:
            del self.by_tenant[tenant]
        else:
            self.by_tenant[tenant] -= 1

    def evict_newest(self, tenant: str) -> None:
        """``tenant``'s newest held request gives way (answered 503 ``model_cold``)."""
        for waiter in reversed(self.waiters):
            if self.tenant_of[waiter] == tenant:
                self.remove(waiter)
                if not waiter.done():
                    waiter.set_result(None)
                return


class ColdHolds:
    """The held requests of one edge, per cold model (the served name a request used)."""

    __slots__ = ("_arrived", "_held", "_since", "cfg", "models", "on_demand")

    def __init__(self, cfg: ColdConfig, on_demand: Callable[[], None] = lambda: None) -> None:
        self.cfg = cfg
        #: Served name (model or adapter) -> its cold entry, from the current table.
        self.models: dict[str, ColdModel] = {}
        #: Called when a cold model gets its first request: the heartbeat goes out now.
        self.on_demand = on_demand
        self._held: dict[str, _Line] = {}
        self._arrived: dict[str, int] = {}
        #: When the first request for a cold model arrived (its replica's expected start).
        self._since: dict[str, float] = {}

    def load(self, table: RoutingTable) -> None:
        self.models = {
            name: cold for cold in table.cold_models for name in (cold.model, *cold.adapters)
        }

    def is_cold(self, name: str) -> bool:
        return name in self.models

    def held(self, name: str) -> int:
        line = self._held.get(name)
        return len(line) if line else 0

    def arrived(self, name: str, now: float) -> None:
        """Count a request for a cold model (held, refused or sent to another region)."""
        first = name not in self._since
        self._arrived[name] = self._arrived.get(name, 0) + 1
        if first:
            self._since[name] = now
            self.on_demand()

    def retry_after(self, name: str, now: float) -> int:
        """Seconds until a replica is expected: its cold start since the first request."""
        cold = self.models.get(name)
        start = self._expected_s(cold) if cold is not None else self.cfg.max_hold_s
        left = self._since.get(name, now) + start - now
        return min(MAX_RETRY_AFTER_S, max(1, math.ceil(left)))

    def _expected_s(self, cold: ColdModel) -> float:
        """Seconds from a first request to a replica serving it."""
        return cold.cold_start_s + self.cfg.margin_s

    def refusal(self, name: str, now: float, why: str) -> EdgeError:
        return EdgeError(
            503,
            f"The model `{name}` is starting (scaled to zero, {why}); retry shortly.",
            "model_cold",
            retry_after=self.retry_after(name, now),
        )

    async def hold(self, name: str, tenant: str = "") -> float:
        """Wait until a table lists a ready instance of ``name``; the seconds waited.
        :class:`EdgeError` 503 ``model_cold`` when the line is full (for ``tenant``: see
        :func:`make_room`), the bound passes, or the request gave way to another tenant's;
        :class:`Released` when the model left the table meanwhile."""
        started = time.monotonic()
        cold = self.models[name]
        line = self._held.setdefault(name, _Line())
        if len(line) >= self.cfg.max_held:
            gives_way = make_room(line.by_tenant, tenant, self.cfg.max_held)
            if gives_way is None:
                raise self.refusal(name, started, f"{len(line)} requests already waiting")
            line.evict_newest(gives_way)
        bound = min(self._expected_s(cold), self.cfg.max_hold_s)
        waiter: asyncio.Future[bool | None] = asyncio.get_running_loop().create_future()
        line.add(waiter, tenant)
        try:
            async with asyncio.timeout(bound):
                served = await asyncio.shield(waiter)
        except TimeoutError:
            raise self.refusal(name, time.monotonic(), f"not ready within {bound:g} s") from None
        finally:
            if not waiter.done():
                waiter.cancel()
            line.remove(waiter)
            if not line and self._held.get(name) is line:
                self._held.pop(name, None)
        if served is None:
            raise self.refusal(name, time.monotonic(), "the line is shared by its tenants")
        if not served:
            raise Released(name)
        return time.monotonic() - started

    async def hold_or_refuse(self, ctx: RequestContext, relay: Relay, outcomes: Counter) -> bool:
        """:meth:`hold` the request; True once it may be served here, False when it was
        refused and answered instead (``outcomes``: counted by model and outcome)."""
        model = ctx.req.model
        try:
            tenant = ctx.tenant.slug if ctx.tenant is not None else ""
            ctx.queue_s += await self.hold(model, tenant)
        except asyncio.CancelledError:
            outcomes.labels(model, "left").inc()  # its client disconnected
            raise
        except (EdgeError, Released) as exc:
            refusal = (
                exc
                if isinstance(exc, EdgeError)
                else EdgeError(
                    404,
                    f"The model `{model}` is no longer deployed here.",
                    "model_not_found",
                    "model",
                )
            )
            outcomes.labels(model, "refused").inc()
            ctx.status = refusal.status
            ctx.complete = True
            await relay.refuse(ctx.send, refusal, model)
            return False
        outcomes.labels(model, "released").inc()
        return True

    def release(self, served: Container[str]) -> None:
        """After a table was applied: release the held requests of each model no longer cold,
        in arrival order — to its instances (``served``) or, when it left the table, refused."""
        for name in list(self._held):
            if name in self.models:
                continue
            for waiter in self._held.pop(name).waiters:
                if not waiter.done():
                    waiter.set_result(name in served)
        for name in list(self._since):
            if name not in self.models:
                del self._since[name]

    def report(self) -> list[dict[str, object]]:
        """The heartbeat's ``cold``: per cold model (its adapters' requests counted with it)
        with demand, requests held now and arrived since the previous report (then reset)."""
        totals: dict[str, list[int]] = {}
        for name in set(self._arrived) | set(self._held):
            cold = self.models.get(name)
            if cold is None:
                continue
            entry = totals.setdefault(cold.model, [0, 0])
            entry[0] += self.held(name)
            entry[1] += self._arrived.get(name, 0)
        for name in list(self._since):
            if not self.held(name) and not self._arrived.get(name):
                del self._since[name]  # a quiet period: the next request starts a new wait
        self._arrived = {}
        return [
            {"model": model, "held": held, "arrived": arrived}
            for model, (held, arrived) in sorted(totals.items())
        ]
