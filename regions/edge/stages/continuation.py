"""The continuation stage: a stream whose engine failed after its first byte goes on elsewhere.

When the engine serving a stream dies, is ejected, or is drained while the stream runs
(``--drain-migrate-after``), the relay raises :class:`StreamCut` instead of ending the client's
stream. Here the answer so far is read from the events relayed, the request is re-sent to
another instance with that answer as its start (``policy/continuation.py``), and the rest is
relayed into the same client stream: same id, no token repeated or lost, one usage and finish.
Candidates are placed as a new request is (residency, health, load: ``place.py``), never one
that already failed it; at most ``max_continuations`` times. What cannot be continued ends as
before, with the reason in the error event and in ``fedinfer_edge_continuations_total``.

Billed once: one usage record, the prompt counted once and the completion the client received;
the prompt processed again (``reprefill_tokens``) and every leg (``legs``) are recorded apart.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from contextlib import nullcontext

from regions.edge.config import EdgeConfig
from regions.edge.http.errors import UpstreamFailure
from regions.edge.http.upstream import Response, UpstreamError
from regions.edge.observability import EdgeMetrics
from regions.edge.policy.continuation import (
    ContinuedTap,
    Relayed,
    continuation_body,
    not_continuable,
    read_relayed,
    text_mode_blocked,
)
from regions.edge.policy.hop import CONTINUATION_HEADER, HOP_HEADER, continuation_signed, sign_hop
from regions.edge.policy.scheduler import Decision
from regions.edge.policy.sessions import SessionMap
from regions.edge.policy.spill import eligible_remotes
from regions.edge.stages.attempt import Attempt, Attempts
from regions.edge.stages.context import Fleet, RequestContext
from regions.edge.stages.place import Placement
from regions.edge.stages.relay import Relay, StreamCut
from regions.edge.stages.spill_over import now_ms
from regions.tables.schema import Instance

log = logging.getLogger("fedinfer.edge")

#: How often streams on drained instances are looked for (with ``--drain-migrate-after``).
DRAIN_CHECK_S = 0.25
#: Why a stream was continued: its engine failed, or it was moved off a drained instance.
ENGINE_LOST = "engine_lost"
DRAIN = "drain"


class Continuation:
    __slots__ = ("attempts", "cfg", "fleet", "metrics", "placement", "relay", "sessions")

    def __init__(
        self,
        cfg: EdgeConfig,
        fleet: Fleet,
        placement: Placement,
        attempts: Attempts,
        relay: Relay,
        sessions: SessionMap,
        metrics: EdgeMetrics,
    ) -> None:
        self.cfg = cfg
        self.fleet = fleet
        self.placement = placement
        self.attempts = attempts
        self.relay = relay
        self.sessions = sessions
        self.metrics = metrics
        if cfg.drain_migrate_after_s is not None:
            relay.streams = {}

    def prepare(self, ctx: RequestContext) -> None:
        """Keep a stream's relayed events when it may be continued."""
        req = ctx.req
        if not req.stream:
            return
        why = (
            not_continuable(req.endpoint.kind, req.doc)
            if self.cfg.max_continuations > 0
            else "disabled"
        )
        if why is None:
            ctx.memory = []
            ctx.memory_room = self.cfg.continue_memory_bytes
        else:
            ctx.uncontinuable = why

    async def resume(self, ctx: RequestContext, cut: StreamCut) -> None:
        """Continue the stream ``cut`` ended, as often as allowed, or end it with the reason."""
        req = ctx.req
        reason = cut.abandoned or ENGINE_LOST
        if ctx.ttft_s is None:
            ctx.ttft_s = cut.ttft
        if ctx.legs is None:
            ctx.legs = [f"{self.cfg.region}/{cut.inst.id}"]
            ctx.continue_reason = reason
        exclude = {cut.inst.id}
        tries = 0
        while True:
            memory = ctx.memory
            relayed = read_relayed(memory, req.endpoint.kind == "chat") if memory else None
            if relayed is not None:
                # From here on the parse is the count: exact, over every leg.
                ctx.relayed_before, ctx.tap = relayed.tokens, None
            why = self._blocked(ctx, relayed, tries)
            if why is None and relayed is not None:
                body = continuation_body(req.endpoint.kind, req.body, relayed)
                if relayed.finish_reason is not None or body is None:
                    self._count(ctx, reason, "ended")
                    await self.relay.end_whole(ctx, cut, relayed)
                    return
                leg = await self._leg(ctx, body, relayed, frozenset(exclude), reason, cut)
                if leg is None:
                    return
                if isinstance(leg, StreamCut):
                    cut, reason = leg, leg.abandoned or ENGINE_LOST
                    exclude.add(leg.inst.id)
                elif leg:
                    exclude.add(leg)
                else:
                    why = "no_instance"
                tries += 1
            if why is not None:
                await self.relay.cut(cut.inst, cut.decision, cut.ttft, cut.failure, ctx, why)
                return

    def _blocked(self, ctx: RequestContext, relayed: Relayed | None, tries: int) -> str | None:
        if relayed is None:
            return ctx.uncontinuable or "too_long"
        why = text_mode_blocked(ctx.req.endpoint.kind, ctx.req.body, relayed)
        if why is not None:
            return why
        if len(ctx.legs or ()) > self.cfg.max_continuations:
            return "max_continuations"
        if tries > self.cfg.max_continuations + self.cfg.max_retries:
            return "retries_spent"
        return None

    async def _leg(
        self,
        ctx: RequestContext,
        body: bytes,
        relayed: Relayed,
        exclude: frozenset[str],
        reason: str,
        cut: StreamCut,
    ) -> StreamCut | str | None:
        """One continuation, here or (no instance here can take it) in another region the
        tenant may use. None: it ended the client's stream; else what to leave out next
        time — the instance that failed before its first byte, or this leg's
        :class:`StreamCut` — or "" when no instance may take it."""
        req = ctx.req
        decision, _ = await self.placement.place(ctx, None, exclude)
        winner = decision.winner
        if winner is None:
            return None if await self._remote(ctx, body, relayed, reason, cut) else ""
        inst = self.fleet.instances[winner.instance]
        tap = ContinuedTap(req.strip_usage, req.endpoint.kind == "chat", relayed)
        prompt = req.prompt_tokens + relayed.tokens
        note = _note(ctx, f"region={self.cfg.region} instance={inst.id}", reason)
        with Attempt(self.attempts, inst, prompt, prompt - winner.cached_tokens) as attempt:
            self.placement.sent(ctx, inst)
            if ctx.session_key is not None:
                self.sessions.remember(ctx.session_key, inst.id)
            try:
                await self._send(ctx, inst, decision, body, tap, note)
            except UpstreamFailure as failure:
                attempt.failed(failure)
                log.warning("continuation on %s failed: %s", inst.id, failure.reason)
                return inst.id
            except StreamCut as again:
                self._continued(ctx, tap, relayed, reason)
                return again
        self._continued(ctx, tap, relayed, reason)
        return None

    async def _send(
        self,
        ctx: RequestContext,
        inst: Instance,
        decision: Decision,
        body: bytes,
        tap: ContinuedTap,
        note: bytes,
    ) -> None:
        """Send the continuation to ``inst`` (a span ``edge.continue`` when traced) and relay
        its stream after the client's; :class:`UpstreamFailure` before its first token,
        :class:`StreamCut` after."""
        trace = ctx.trace
        with trace.leg("edge.continue", inst.id) if trace is not None else nullcontext() as hop:
            traceparent = hop.traceparent if hop is not None else ctx.traceparent
            try:
                resp = await self.fleet.upstream.post(
                    inst.url, ctx.req.path, body, [(b"traceparent", traceparent.encode())]
                )
            except UpstreamError as exc:
                raise UpstreamFailure(str(exc), connect=True) from exc
            await _relay_answer(
                resp, lambda: self.relay.continued(resp, inst, decision, ctx, tap, note)
            )

    async def _remote(
        self, ctx: RequestContext, body: bytes, relayed: Relayed, reason: str, cut: StreamCut
    ) -> bool:
        """Continue in another region the tenant may use (no instance here can): True when
        one took it (and ended the client's stream)."""
        spill = ctx.spill
        if spill is None:
            return False
        headers = [(b"traceparent", ctx.traceparent.encode()), (CONTINUATION_HEADER, b"1")]
        if spill.authorization is not None:
            headers.append((b"authorization", spill.authorization))
        if spill.session is not None:
            headers.append((b"x-session-id", spill.session))
        for remote in eligible_remotes(spill.remotes, spill.allowed, None, 0.0, spill.point):
            for url in remote.edge_urls:
                tap = ContinuedTap(ctx.req.strip_usage, ctx.req.endpoint.kind == "chat", relayed)
                try:
                    await self._send_remote(ctx, remote.code, url, body, headers, tap, reason, cut)
                except (UpstreamError, UpstreamFailure) as exc:
                    log.warning("continuation in %s (%s) failed: %s", remote.code, url, exc)
                    continue
                self._continued(ctx, tap, relayed, reason)
                return True
        return False

    async def _send_remote(
        self,
        ctx: RequestContext,
        remote: str,
        url: str,
        body: bytes,
        headers: list[tuple[bytes, bytes]],
        tap: ContinuedTap,
        reason: str,
        cut: StreamCut,
    ) -> None:
        """One remote edge: the continuation signed for it (covering the marker), relayed."""
        cfg = self.cfg
        authorization = ctx.spill.authorization if ctx.spill is not None else None
        signed = continuation_signed(body)
        hop = sign_hop(cfg.hop_keys, cfg.region, remote, authorization, signed, now_ms())
        resp = await self.fleet.upstream.post(
            url, ctx.req.path, body, [*headers, (HOP_HEADER, hop)]
        )
        note = _note(ctx, f"region={remote}", reason)
        await _relay_answer(
            resp, lambda: self.relay.continued_remote(resp, remote, cut, ctx, tap, note)
        )

    def _elsewhere(self, ctx: RequestContext) -> bool:
        """Whether a drained stream has somewhere to go: an instance of its model in the table,
        or a region its tenant may use; else it runs to its end where it is."""
        if self.fleet.by_model.get(ctx.req.model):
            return True
        spill = ctx.spill
        return spill is not None and bool(
            eligible_remotes(spill.remotes, spill.allowed, None, 0.0, spill.point)
        )

    def _continued(
        self, ctx: RequestContext, tap: ContinuedTap, relayed: Relayed, reason: str
    ) -> None:
        """A leg took the stream up: what its engine read again (its report, else the edge's
        count of the prompt and the answer so far) is the operator's cost."""
        ctx.reprefill_tokens += tap.reprefill_tokens or ctx.req.prompt_tokens + relayed.tokens
        self._count(ctx, reason, "continued")

    def _count(self, ctx: RequestContext, reason: str, outcome: str) -> None:
        self.metrics.continuations.labels(ctx.req.model, reason, outcome).inc()

    async def watch_drains(self) -> None:
        """Move streams off instances that left the table once they ran there
        ``drain_migrate_after_s``: a drained instance is then idle in about that long."""
        after = self.cfg.drain_migrate_after_s
        streams = self.relay.streams
        assert after is not None and streams is not None
        while True:
            await asyncio.sleep(DRAIN_CHECK_S)
            instances = self.fleet.instances
            now = time.monotonic()
            for inst_id, running in list(streams.items()):
                if inst_id in instances:
                    continue
                for ctx in list(running.values()):
                    resp = ctx.upstream
                    if (
                        resp is not None
                        and ctx.memory is not None
                        and ctx.abandoned is None
                        and now - ctx.upstream_since >= after
                        and self._elsewhere(ctx)
                    ):
                        ctx.abandoned = DRAIN
                        resp.abandon(UpstreamError(f"instance {inst_id} drained"))


def _note(ctx: RequestContext, where: str, reason: str) -> bytes:
    """The SSE comment that names a continuation's leg (clients ignore comments)."""
    leg = len(ctx.legs or ()) + 1
    return f": x-fedinfer-route continued {where} after={reason} leg={leg}\n\n".encode()


async def _relay_answer(resp: Response, relay: Callable[[], Awaitable[bool]]) -> None:
    """Relay a continuation's answer with ``relay``: only a 200 (a refusal of the continuation,
    its prompt grown past the context say, is no answer to relay: another is tried). Its
    connection goes back to the pool when read whole, else it is closed."""
    clean = False
    try:
        if resp.status != 200:
            raise UpstreamFailure(f"status {resp.status}", connect=resp.status >= 500)
        clean = await relay()
    finally:
        if clean:
            resp.release()
        else:
            resp.close()
