"""The forward stage: send a request to the instance placed, retry elsewhere before byte one.

:meth:`Forwarder.serve` is the single-hop path: place (``place.py``), try the winner over a
pooled keep-alive connection (``upstream.py``), and on a failure before anything reached the
client try another instance, at most ``max_retries`` times and only while the engine cannot be
running the request; after it, a stream goes on elsewhere (``continuation.py``). A first
placement may send it to another region instead (``spill_over.py``).
:meth:`Forwarder.forward` is one try; P/D's decode leg uses it too.
"""

from __future__ import annotations

import time

from regions.edge.config import EdgeConfig
from regions.edge.http.errors import UpstreamFailure
from regions.edge.http.upstream import UpstreamError
from regions.edge.observability import EdgeMetrics
from regions.edge.policy.prefix_index import PrefixIndex
from regions.edge.policy.scheduler import Decision
from regions.edge.policy.sessions import SessionMap
from regions.edge.stages.attempt import Attempt, Attempts
from regions.edge.stages.context import Fleet, RequestContext
from regions.edge.stages.continuation import Continuation
from regions.edge.stages.place import SPILL, Placement
from regions.edge.stages.relay import Relay, StreamCut, may_retry
from regions.edge.stages.spill_over import SpillOver
from regions.tables.schema import Instance


class Forwarder:
    __slots__ = (
        "attempts",
        "cfg",
        "continuation",
        "fleet",
        "metrics",
        "peers",
        "placement",
        "prefix",
        "relay",
        "sessions",
        "spill_over",
    )

    def __init__(
        self,
        cfg: EdgeConfig,
        fleet: Fleet,
        placement: Placement,
        attempts: Attempts,
        relay: Relay,
        spill_over: SpillOver,
        sessions: SessionMap,
        metrics: EdgeMetrics,
    ) -> None:
        self.cfg = cfg
        self.fleet = fleet
        self.placement = placement
        self.prefix: PrefixIndex = placement.prefix
        self.attempts = attempts
        self.relay = relay
        self.spill_over = spill_over
        self.sessions = sessions
        self.metrics = metrics
        #: Told of every session placed on a new instance: its placement's peers.
        self.peers = placement.peers
        self.continuation = Continuation(cfg, fleet, placement, attempts, relay, sessions, metrics)

    async def serve(self, ctx: RequestContext) -> None:
        """Place and forward until an answer (or a refusal) reached the client."""
        req = ctx.req
        self.continuation.prepare(ctx)
        session_key = ctx.session_key
        sticky = self.sessions.get(session_key) if session_key is not None else None
        exclude: frozenset[str] = frozenset()
        spill = first_pass = ctx.spill
        while True:
            decision, waited = await self.placement.place(ctx, sticky, exclude, first_pass)
            first_pass = None
            ctx.queue_s += waited
            if decision is SPILL and spill is not None:
                if await self.spill_over.forward(spill, ctx, fallback=True):
                    return
                continue  # every remote failed before its first byte: serve it here
            winner = decision.winner
            if winner is None:
                ctx.complete = True
                await self.relay.no_capacity(ctx, decision)
                return
            inst = self.fleet.instances[winner.instance]
            uncached = req.prompt_tokens - winner.cached_tokens
            cut: StreamCut | None = None
            with Attempt(self.attempts, inst, req.prompt_tokens, uncached) as attempt:
                self.placement.sent(ctx, inst)
                if (
                    session_key is not None
                    and self.sessions.remember(session_key, inst.id)
                    and self.peers is not None  # the other edges keep it there too
                ):
                    self.peers.session_placed(session_key, inst.id)
                try:
                    await self.forward(inst, decision, ctx)
                    return
                except StreamCut as lost:
                    cut = lost  # continued below, once this try has let its slot go
                except UpstreamFailure as failure:
                    attempt.failed(failure)
                    if not await self._may_retry(ctx, inst.id, failure, decision):
                        return
                    exclude = exclude | {inst.id}
                    sticky = None
                    # Placed again as a new request: the failed instance may have been the
                    # region's last, and another region may take it now.
                    first_pass = spill
            if cut is not None:
                await self.continuation.resume(ctx, cut)
                return

    async def _may_retry(
        self, ctx: RequestContext, instance: str, failure: UpstreamFailure, decision: Decision
    ) -> bool:
        """After ``instance`` failed before anything reached the client: True to try another,
        False once the retries are spent or it may have run (the error is then answered)."""
        ctx.last_failure = f"{instance}: {failure.reason}"
        if ctx.retries >= self.cfg.max_retries or not failure.retry:
            ctx.complete = True
            await self.relay.upstream_failed(ctx, decision)
            return False
        ctx.retries += 1
        self.metrics.retries.labels(ctx.req.model).inc()
        return True

    async def serve_unqueued(self, ctx: RequestContext) -> None:
        """A call that takes no slot (the tokenizer's): to the least loaded healthy instance of
        its model at once, never queued, not counted in any load; retried elsewhere like
        :meth:`serve` while nothing reached the client."""
        req = ctx.req
        exclude: frozenset[str] = frozenset()
        health = self.attempts.health
        while True:
            decision = self.placement.place_unqueued(req.model, exclude)
            winner = decision.winner
            if winner is None:
                ctx.complete = True
                await self.relay.no_capacity(ctx, decision)
                return
            inst = self.fleet.instances[winner.instance]
            try:
                await self.forward(inst, decision, ctx)
                return
            except UpstreamFailure as failure:
                if failure.connect:
                    health.connect_error(inst.id, failure.reason)
                else:
                    health.failure(inst.id, failure.reason)
                if not await self._may_retry(ctx, inst.id, failure, decision):
                    return
                exclude = exclude | {inst.id}

    async def forward(
        self,
        inst: Instance,
        decision: Decision,
        ctx: RequestContext,
        body: bytes | None = None,
        headers: tuple[tuple[bytes, bytes], ...] = (),
        leg: str = "edge.upstream",
    ) -> None:
        """Send to ``inst`` (``body``: another than the client's, for a P/D leg), pass the
        answer through; :class:`UpstreamFailure` before byte one. Traced as span ``leg``."""
        trace = ctx.trace
        if trace is None:
            await self._forward(inst, decision, ctx, body, headers, ctx.traceparent)
            return
        with trace.leg(leg, inst.id) as hop:
            await self._forward(inst, decision, ctx, body, headers, hop.traceparent)

    async def _forward(
        self,
        inst: Instance,
        decision: Decision,
        ctx: RequestContext,
        body: bytes | None,
        headers: tuple[tuple[bytes, bytes], ...],
        traceparent: str,
    ) -> None:
        req = ctx.req
        t0 = time.perf_counter()
        try:
            resp = await self.fleet.upstream.post(
                inst.url,
                req.path,
                req.body if body is None else body,
                [(b"traceparent", traceparent.encode()), *headers],
            )
        except UpstreamError as exc:
            raise UpstreamFailure(str(exc), connect=True, retry=may_retry(exc)) from exc
        connect_s = time.perf_counter() - t0
        ctx.served_by = inst  # it accepted the request: from here on, usage is recorded
        clean = False
        try:
            if resp.status >= 500:
                raise UpstreamFailure(f"status {resp.status}", connect=False)
            clean = await self.relay.answer(resp, inst, decision, connect_s, ctx)
        finally:
            # A fully read response returns its connection to the pool; anything else closes
            # it, which is how the engine learns to abort the request.
            if clean:
                resp.release()
            else:
                resp.close()
