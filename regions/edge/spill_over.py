"""Spill-over: forward a request to another region's edge (where to: ``spill.py``, pure).

The first remote edge that answers before its first byte gets the request; a request that
may already run remotely is never sent to a second one. The forwarded request is signed for
that remote (``hop.py``), so it is rate-charged only here.
"""

from __future__ import annotations

import logging
import time

from regions.edge.config import EdgeConfig
from regions.edge.context import Fleet, RequestContext
from regions.edge.errors import EdgeError, UpstreamFailure
from regions.edge.hop import HOP_HEADER, sign_hop
from regions.edge.observability import EdgeMetrics
from regions.edge.relay import Relay, may_retry
from regions.edge.route import spill_failed_route
from regions.edge.spill import Remote, Spill
from regions.edge.upstream import UpstreamError

log = logging.getLogger("fedinfer.edge")


class SpillOver:
    __slots__ = ("cfg", "fleet", "metrics", "relay")

    def __init__(self, cfg: EdgeConfig, fleet: Fleet, relay: Relay, metrics: EdgeMetrics) -> None:
        self.cfg = cfg
        self.fleet = fleet
        self.relay = relay
        self.metrics = metrics

    async def forward(self, spill: Spill, ctx: RequestContext, fallback: bool) -> bool:
        """Forward to the first of ``spill.targets`` that answers before its first byte.

        False (nothing sent) when every remote failed and ``fallback``: serve locally instead.
        """
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
        tries = spill.targets[: self.cfg.max_retries + 1]
        may_run_remotely = False  # a remote may be serving it: never send it elsewhere
        for remote in tries:
            last = remote is tries[-1] and not fallback
            try:
                if await self._try(remote, spill, headers, last, ctx):
                    return True
            except UpstreamFailure as failure:
                failures.append(f"{remote.code}: {failure.reason}")
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

    async def _try(
        self,
        remote: Remote,
        spill: Spill,
        headers: list[tuple[bytes, bytes]],
        last: bool,
        ctx: RequestContext,
    ) -> bool:
        """One remote edge; True when its answer was relayed. :class:`UpstreamFailure` when it
        failed before its first byte (a 5xx answer too, unless it is the ``last`` try: then
        that answer is relayed)."""
        req = ctx.req
        cfg = self.cfg
        self.metrics.spills.labels(remote.code, spill.why).inc()
        # Signed for this remote (and this try): a value is good at one region, once.
        hop = sign_hop(
            cfg.hop_keys, cfg.region, remote.code, spill.authorization, req.body, _now_ms()
        )
        t0 = time.perf_counter()
        try:
            resp = await self.fleet.upstream.post(
                remote.edge_url, req.path, req.body, [*headers, (HOP_HEADER, hop)]
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


def _now_ms() -> int:
    return int(time.time() * 1000)
