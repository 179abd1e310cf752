"""The spill-over stage: whether a request goes to another region's edge before this region
is tried, and why (at admission: :meth:`SpillOver.plan`, the rule in ``spill.py``); sending it
there first, or holding it while its model is scaled to zero here (:meth:`SpillOver.first`);
and forwarding it to another region's edge (:meth:`SpillOver.forward`, also when the first
placement finds a remote sooner: ``place.py``).

The first remote edge that answers before its first byte gets the request; a request that
may already run remotely is never sent to a second one. The forwarded request is signed for
that remote (``hop.py``), so it is rate-charged only here.

A region may have several edges (schema 4): a request starts at the one its point picks (its
session's, so a session keeps meeting the same remote edge and its session and prefix state),
else the next in turn, and moves to that region's next edge when one fails before its first
byte. An edge that could not be reached is passed over for :data:`EDGE_DOWN_S` (unless all are).
"""

from __future__ import annotations

import logging
import time

from regions.edge.config import EdgeConfig
from regions.edge.http.errors import EdgeError, UpstreamFailure
from regions.edge.http.parse import ParsedRequest
from regions.edge.http.upstream import UpstreamError
from regions.edge.observability import EdgeMetrics
from regions.edge.policy.admission import TenantState
from regions.edge.policy.hop import HOP_HEADER, sign_hop
from regions.edge.policy.route import spill_failed_route
from regions.edge.policy.spill import Remote, Spill, first_targets, ramp_point, refusal
from regions.edge.stages.cold import ColdHolds
from regions.edge.stages.context import Fleet, RequestContext
from regions.edge.stages.relay import Relay, may_retry

log = logging.getLogger("fedinfer.edge")

#: Seconds a remote edge that could not be reached is tried last.
EDGE_DOWN_S = 5.0


class SpillOver:
    __slots__ = ("_down_until", "_turn", "cfg", "cold", "fleet", "metrics", "overflow", "relay")

    def __init__(
        self, cfg: EdgeConfig, fleet: Fleet, relay: Relay, metrics: EdgeMetrics, cold: ColdHolds
    ) -> None:
        self.cfg = cfg
        self.fleet = fleet
        self.relay = relay
        self.metrics = metrics
        self.cold = cold
        #: Remote edge URL -> monotonic time until which it is tried last.
        self._down_until: dict[str, float] = {}
        self._turn = 0
        #: Model -> requests being served elsewhere for want of capacity here (``Spill.overflow``),
        #: reported in the heartbeat (``spill.overflow_shares``).
        self.overflow: dict[str, int] = {}

    def plan(
        self,
        req: ParsedRequest,
        tenant: TenantState | None,
        point_key: bytes,
        hopped: bool,
        authorization: bytes | None,
        session_id: bytes | None,
    ) -> Spill | None:
        """Where else the request may go (None: only here); with ``targets`` set when it must
        go there first. :class:`EdgeError` when neither here nor an allowed remote can take it.
        ``point_key``: its session, else its body (``spill.ramp_point``); a request that
        already ``hopped`` is served here or refused, never forwarded again."""
        fleet = self.fleet
        model = req.model
        remotes = () if hopped else fleet.spill.get(model, ())
        allowed = tenant.allowed if tenant is not None else None
        local_ok = tenant is None or tenant.local_allowed
        split = fleet.splits.get(model) if remotes else None
        point = 0.0
        if remotes and (fleet.ramping or split):
            point = ramp_point(point_key)
        elif remotes and session_id is not None and fleet.several_edges:
            point = ramp_point(session_id)  # a session meets the same remote edge
        here = model in fleet.by_model
        cold = not here and model in fleet.cold_models
        if local_ok and (here or cold) and not remotes:
            return None
        first = first_targets(
            remotes,
            allowed,
            local_ok=local_ok,
            here=here,
            cold=cold,
            local_ramp=fleet.table.ramp,
            point=point,
        )
        if first is None:
            spilled = fleet.spill
            raise refusal(
                self.cfg.region,
                model,
                (tenant.slug, tenant.allowed) if tenant is not None else None,
                local_ok=local_ok,
                hopped=hopped,
                served_elsewhere=model in spilled,
                routed_here=any(r.model == model for r in fleet.table.routes),
                retry_after_s=self.cfg.retry_after_s,
            )
        targets, why = first
        if cold and not targets:
            return None  # held here until a replica starts: no remote may take it now
        spill = Spill(remotes, allowed, authorization, session_id, point, split)
        spill.targets, spill.why = targets, why
        return spill

    async def first(self, ctx: RequestContext) -> bool:
        """Send the request to another region first when :meth:`plan` said so, hold it while
        its model is scaled to zero here; True when it is to be served here now."""
        model = ctx.req.model
        cold = model not in self.fleet.by_model and model in self.cold.models
        if cold:
            self.cold.arrived(model, time.monotonic())
        spill = ctx.spill
        if spill is not None and spill.targets:
            # A region coming back, or a cold model here, can serve the request itself when
            # no remote answers.
            fallback = spill.why in ("ramp", "cold")
            if await self.forward(spill, ctx, fallback=fallback):
                if cold:
                    self.metrics.cold.labels(model, "spilled").inc()
                return False
            ctx.spill = None
        return not cold or await self.cold.hold_or_refuse(ctx, self.relay, self.metrics.cold)

    async def forward(self, spill: Spill, ctx: RequestContext, fallback: bool) -> bool:
        """Forward to the first of ``spill.targets`` that answers before its first byte.

        False (nothing sent) when every remote failed and ``fallback``: serve locally instead.
        """
        if not spill.overflow:
            return await self._traced(spill, ctx, fallback)
        model = ctx.req.model
        overflow = self.overflow
        overflow[model] = overflow.get(model, 0) + 1
        try:
            return await self._traced(spill, ctx, fallback)
        finally:
            if overflow[model] <= 1:
                del overflow[model]
            else:
                overflow[model] -= 1

    async def _traced(self, spill: Spill, ctx: RequestContext, fallback: bool) -> bool:
        trace = ctx.trace
        if trace is None:
            return await self._forward(spill, ctx, fallback, ctx.traceparent)
        with trace.leg("edge.spill", ",".join(r.code for r in spill.targets)) as hop:
            return await self._forward(spill, ctx, fallback, hop.traceparent)

    async def _forward(
        self, spill: Spill, ctx: RequestContext, fallback: bool, traceparent: str
    ) -> bool:
        headers = [(b"traceparent", traceparent.encode())]
        if spill.authorization is not None:
            headers.append((b"authorization", spill.authorization))
        if spill.session is not None:
            headers.append((b"x-session-id", spill.session))
        failures: list[str] = []
        tries = [
            (remote, url)
            for remote in spill.targets[: self.cfg.max_retries + 1]
            for url in self._edge_order(remote, spill.point)
        ]
        may_run_remotely = False  # a remote may be serving it: never send it elsewhere
        for n, (remote, url) in enumerate(tries, 1):
            last = n == len(tries) and not fallback
            try:
                if await self._try(remote, url, spill, headers, last, ctx):
                    return True
            except UpstreamFailure as failure:
                failures.append(f"{remote.code} ({url}): {failure.reason}")
                if failure.connect:
                    self._down_until[url] = time.monotonic() + EDGE_DOWN_S
                if not failure.retry:
                    may_run_remotely = True
                    break
        log.warning("spill-over of %s failed: %s", ctx.req.model, "; ".join(failures))
        if fallback and not may_run_remotely:
            return False
        ctx.complete = True
        err = EdgeError(
            502,
            "no remote region could take the request; retry later",
            "upstream_error",
            retry_after=self.cfg.retry_after_s,
        )
        route = spill_failed_route(self.cfg.region, spill.why)
        ctx.status = err.status
        await self.relay.refuse(ctx.send, err, ctx.req.model, "", route)
        return True

    def _edge_order(self, remote: Remote, point: float) -> list[str]:
        """``remote``'s edges in the order to try: from the one the request's point picks (or
        the next in turn without one), those recently unreachable last."""
        urls = remote.edge_urls
        if len(urls) == 1:
            return [urls[0]]
        if point:
            start = int(point * len(urls))
        else:
            self._turn += 1
            start = self._turn % len(urls)
        ordered = urls[start:] + urls[:start]
        now = time.monotonic()
        down = self._down_until
        return [u for u in ordered if down.get(u, 0.0) <= now] + [
            u for u in ordered if down.get(u, 0.0) > now
        ]

    async def _try(
        self,
        remote: Remote,
        url: str,
        spill: Spill,
        headers: list[tuple[bytes, bytes]],
        last: bool,
        ctx: RequestContext,
    ) -> bool:
        """One edge of ``remote``, at ``url``; True when its answer was relayed.
        :class:`UpstreamFailure` when it failed before its first byte (a 5xx answer too,
        unless it is the ``last`` try: then that answer is relayed)."""
        req = ctx.req
        cfg = self.cfg
        self.metrics.spills.labels(remote.code, spill.why).inc()
        # Signed for this remote (and this try): a value is good at one region, once.
        hop = sign_hop(
            cfg.hop_keys, cfg.region, remote.code, spill.authorization, req.body, now_ms()
        )
        t0 = time.perf_counter()
        try:
            resp = await self.fleet.upstream.post(
                url, req.path, req.body, [*headers, (HOP_HEADER, hop)]
            )
        except UpstreamError as exc:
            raise UpstreamFailure(str(exc), connect=True, retry=may_retry(exc)) from exc
        connect_s = time.perf_counter() - t0
        clean = False
        try:
            if resp.status >= 500 and not last:
                raise UpstreamFailure(f"status {resp.status}", connect=False)
            await self.relay.remote(resp, remote, spill.why, connect_s, ctx)
            clean = True
            return True
        finally:
            if clean:
                resp.release()
            else:
                resp.close()


def now_ms() -> int:
    return int(time.time() * 1000)
