"""The relay stage: every byte the client gets, written here.

An engine's answer is passed through byte for byte (:meth:`Relay.answer`): a whole JSON body,
or an SSE stream whose headers wait for its first bytes (so a failure before then can still be
retried elsewhere) and whose usage chunk is read in passing (``parse.UsageTap``). A remote
edge's answer likewise (:meth:`Relay.remote`). Refusals are OpenAI-style error bodies
(:meth:`Relay.error`). Each answer is recorded (``record.py``).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from regions.edge.http.errors import (
    EdgeError,
    UpstreamFailure,
    responses_error_event,
    sse_error_event,
)
from regions.edge.http.parse import ResponsesTap, UsageTap, body_usage
from regions.edge.http.server import Send
from regions.edge.http.upstream import Response, UpstreamError
from regions.edge.observability import EdgeMetrics, server_timing
from regions.edge.policy.continuation import ContinuedTap, Relayed, finish_event, usage_event
from regions.edge.policy.route import remote_route, route_field, route_header
from regions.edge.policy.scheduler import Decision
from regions.edge.policy.spill import Remote
from regions.edge.stages.context import RequestContext
from regions.edge.stages.record import Recorder
from regions.edge.view.health import HealthBoard
from regions.tables.schema import Instance

log = logging.getLogger("fedinfer.edge")

JSON = b"application/json"
_SSE = b"text/event-stream"
_ROUTE = b"x-fedinfer-route"
_CUT = "upstream_stream_cut"


def may_retry(exc: UpstreamError) -> bool:
    """Another upstream may take the request: this one never got it, or dropped it itself."""
    return not exc.sent or exc.dropped


async def respond(send: Send, status: int, body: bytes, ctype: bytes) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", ctype), (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})


async def _first_bytes(resp: Response, tap: UsageTap) -> bytes:
    """A stream's first whole events; :class:`UpstreamFailure` when none arrive."""
    first = b""
    try:
        while not first:
            chunk = await resp.readany()
            if not chunk:
                # The engine ended the stream itself: it is not running the request.
                raise UpstreamFailure("closed before the first byte", connect=True)
            first = tap.feed(chunk)
    except UpstreamError as exc:
        raise UpstreamFailure(f"stream: {exc}", connect=True, retry=may_retry(exc)) from exc
    return first


class StreamCut(Exception):
    """The engine failed after the client got the first bytes of its stream, which may be
    continued elsewhere (``continuation.py``); ``abandoned``: the edge gave it up (a drain)."""

    def __init__(
        self, inst: Instance, decision: Decision, ttft: float, failure: str, abandoned: str | None
    ) -> None:
        super().__init__(failure)
        self.inst = inst
        self.decision = decision
        self.ttft = ttft
        self.failure = failure
        self.abandoned = abandoned


class Relay:
    __slots__ = ("health", "metrics", "recorder", "region", "retry_after_s", "streams")

    def __init__(
        self,
        region: str,
        retry_after_s: int,
        health: HealthBoard,
        metrics: EdgeMetrics,
        recorder: Recorder,
    ) -> None:
        self.region = region
        self.retry_after_s = retry_after_s
        self.health = health
        self.metrics = metrics
        self.recorder = recorder
        #: Instance -> the streams it is sending now, kept only while drains move streams
        #: (``continuation.Continuation.watch_drains``).
        self.streams: dict[str, dict[int, RequestContext]] | None = None

    def _route(self, decision: Decision, ctx: RequestContext) -> bytes:
        return ctx.route or route_header(self.region, decision, ctx.retries, view=ctx.view)

    async def answer(
        self,
        resp: Response,
        inst: Instance,
        decision: Decision,
        connect_s: float,
        ctx: RequestContext,
    ) -> bool:
        """Pass ``inst``'s answer (status below 500) through; True when it was read in full
        (the connection may be pooled again). :class:`UpstreamFailure` before byte one."""
        ctype = resp.headers.get(b"content-type", JSON)
        status = resp.status
        if ctx.req.stream and status == 200 and ctype.startswith(_SSE):
            return await self._stream(resp, inst, decision, connect_s, ctype, ctx)
        try:
            body = await resp.read()
        except UpstreamError as exc:
            raise UpstreamFailure(f"read: {exc}", connect=True, retry=may_retry(exc)) from exc
        ttft = time.perf_counter() - ctx.arrived
        headers_out = [
            (b"content-type", ctype),
            (b"content-length", str(len(body)).encode()),
            (_ROUTE, self._route(decision, ctx)),
            (b"server-timing", server_timing(ctx.queue_s, connect_s, ttft) + ctx.timing_extra),
            (b"traceparent", ctx.traceparent.encode()),
        ]
        ctx.sent = True
        send = ctx.send
        await send({"type": "http.response.start", "status": status, "headers": headers_out})
        ctx.complete = True
        await send({"type": "http.response.body", "body": body})
        if status == 200:
            self.health.success(inst.id)
            prompt, cached, completion = body_usage(body)
            if prompt is not None and completion is not None:
                ctx.used_tokens = prompt + completion
            self.recorder.served(ctx, decision, inst.id, status, ttft, prompt, cached)
        else:
            self.recorder.served(ctx, decision, inst.id, status, None, None, None)
        return True

    async def _stream(
        self,
        resp: Response,
        inst: Instance,
        decision: Decision,
        connect_s: float,
        ctype: bytes,
        ctx: RequestContext,
    ) -> bool:
        """Pass the SSE stream through; True when it ended cleanly (``[DONE]``; a Responses
        stream: ``response.completed``). :class:`StreamCut` when it failed after its first
        byte and may be continued elsewhere."""
        req = ctx.req
        tap = ctx.tap = (
            ResponsesTap() if req.endpoint.kind == "responses" else UsageTap(req.strip_usage)
        )
        # Hold the response headers until the first bytes arrive, so a failure before then can
        # still be retried on another instance.
        first = await _first_bytes(resp, tap)
        ttft = time.perf_counter() - ctx.arrived
        headers_out = [
            (b"content-type", ctype),
            (b"cache-control", b"no-cache"),
            (_ROUTE, self._route(decision, ctx)),
            (b"server-timing", server_timing(ctx.queue_s, connect_s, ttft) + ctx.timing_extra),
            (b"traceparent", ctx.traceparent.encode()),
        ]
        ctx.sent = True
        send = ctx.send
        await send({"type": "http.response.start", "status": 200, "headers": headers_out})
        self._remember(ctx, first)
        await send({"type": "http.response.body", "body": first, "more_body": True})
        failure = await self._follow(resp, inst.id, tap, ctx)
        if failure:
            self._lost(inst, failure, ctx)
            if ctx.memory is not None:
                raise StreamCut(inst, decision, ttft, failure, ctx.abandoned)
            await self._cut_event(inst, decision, ttft, ctx, ctx.uncontinuable or "")
            return False
        if isinstance(tap, ResponsesTap) and tap.first_token_at is not None:
            # A Responses stream opens before its prefill: its first token is the first text.
            ttft = tap.first_token_at - ctx.arrived
        self.health.success(inst.id)
        await self._end(ctx)
        self.recorder.served(
            ctx, decision, inst.id, 200, ttft, tap.prompt_tokens, tap.cached_tokens
        )
        if tap.prompt_tokens is not None and tap.completion_tokens is not None:
            ctx.used_tokens = tap.prompt_tokens + tap.completion_tokens
        return True

    async def continued(
        self,
        resp: Response,
        inst: Instance,
        decision: Decision,
        ctx: RequestContext,
        tap: ContinuedTap,
        note: bytes,
    ) -> bool:
        """Relay a continuation's stream into the client's (``continuation.py``), after the
        SSE comment ``note`` that names the leg; True when it ended cleanly.
        :class:`UpstreamFailure` before its first token, :class:`StreamCut` after."""
        failure = await self._leg(resp, f"{self.region}/{inst.id}", inst, ctx, tap, note)
        ttft = ctx.ttft_s or 0.0
        if failure:
            self._lost(inst, failure, ctx)
            raise StreamCut(inst, decision, ttft, failure, ctx.abandoned)
        self.health.success(inst.id)
        await self._finish_continued(inst.id, decision, ttft, tap, ctx)
        return True

    async def continued_remote(
        self,
        resp: Response,
        remote: str,
        cut: StreamCut,
        ctx: RequestContext,
        tap: ContinuedTap,
        note: bytes,
    ) -> bool:
        """The same with another region's edge continuing it (it records no usage: this edge
        does). A remote that fails after its first token ends the stream: it continues its
        own streams itself, so its failure is its region's. True when it ended cleanly."""
        where = route_field(resp.headers.get(_ROUTE, b""), "instance") or "?"
        failure = await self._leg(resp, f"{remote}/{where}", None, ctx, tap, note)
        if failure:
            log.warning("remote region %s failed continuing a stream: %s", remote, failure)
            await self._cut_event(cut.inst, cut.decision, cut.ttft, ctx, "remote_failed")
            return False
        await self._finish_continued(f"remote:{remote}", cut.decision, cut.ttft, tap, ctx)
        return True

    async def _leg(
        self,
        resp: Response,
        leg: str,
        inst: Instance | None,
        ctx: RequestContext,
        tap: ContinuedTap,
        note: bytes,
    ) -> str:
        """Relay one continuation leg (``inst``: here; None: a remote edge) once its first
        token came: why it failed, or ""."""
        first = await _first_bytes(resp, tap)
        if inst is not None:
            ctx.served_by = inst  # the record names the instance that finished the answer
        ctx.tap = tap
        ctx.abandoned = None
        if ctx.legs is not None:
            ctx.legs.append(leg)
        self._remember(ctx, first)
        await ctx.send({"type": "http.response.body", "body": note + first, "more_body": True})
        return await self._follow(resp, inst.id if inst is not None else None, tap, ctx)

    async def _finish_continued(
        self, instance: str, decision: Decision, ttft: float, tap: ContinuedTap, ctx: RequestContext
    ) -> None:
        await self._end(ctx)
        usage = tap.client_usage()
        if usage is None:
            self.recorder.served(ctx, decision, instance, 200, ttft, None, None)
            return
        ctx.used_tokens = usage[0] + usage[2]
        self.recorder.served(ctx, decision, instance, 200, ttft, usage[0], usage[1])

    async def _follow(
        self, resp: Response, instance: str | None, tap: UsageTap, ctx: RequestContext
    ) -> str:
        """Relay the rest of a stream: why it failed, or "" when it ended whole. While it
        runs on ``instance`` (here), a drain may abandon it (``ctx.upstream``)."""
        streams = self.streams
        # A remote edge's stream (no instance here) is its region's to move.
        running = None
        if streams is not None and instance is not None:
            ctx.upstream, ctx.upstream_since = resp, time.monotonic()
            running = streams.get(instance)
            if running is None:  # no dict built per stream for an instance already sending
                running = streams[instance] = {}
            running[id(ctx)] = ctx
        # Inter-token latency: the gap before each chunk passed on (a float per chunk).
        itl = self.metrics.itl_histo(ctx.req.model)
        send = ctx.send
        last = time.perf_counter()
        memory = ctx.memory
        try:
            while True:
                chunk = await resp.readany()
                if not chunk:
                    break
                out = tap.feed(chunk)
                if out:
                    now = time.perf_counter()
                    itl.observe(now - last)
                    last = now
                    if memory is not None:
                        room = ctx.memory_room = ctx.memory_room - len(out)
                        if room >= 0:
                            memory.append(out)
                        else:  # too long to keep: this stream can no longer be continued
                            ctx.memory = memory = None
                            ctx.uncontinuable = "too_long"
                    await send({"type": "http.response.body", "body": out, "more_body": True})
        except UpstreamError as exc:
            return str(exc)
        finally:
            if running is not None:  # it holds this stream until now, so it is still listed
                ctx.upstream = None
                del running[id(ctx)]
                if not running and streams is not None and instance is not None:
                    del streams[instance]
        return "" if tap.done else "stream ended without [DONE]"

    @staticmethod
    def _remember(ctx: RequestContext, first: bytes) -> None:
        memory = ctx.memory
        if memory is not None:
            ctx.memory_room -= len(first)
            if ctx.memory_room >= 0:
                memory.append(first)
            else:
                ctx.memory, ctx.uncontinuable = None, "too_long"

    @staticmethod
    async def _end(ctx: RequestContext) -> None:
        """The stream ended whole: its last bytes."""
        ctx.complete = True
        tap = ctx.tap
        await ctx.send({"type": "http.response.body", "body": tap.pending if tap else b""})

    def _lost(self, inst: Instance, failure: str, ctx: RequestContext) -> None:
        """The engine failed mid-stream: count it, and against its health unless the edge
        gave the stream up itself (a drain)."""
        self.metrics.midstream_failures.labels(inst.id).inc()
        if ctx.abandoned is None:
            self.health.connect_error(inst.id, f"mid-stream: {failure}")
            log.warning("instance %s failed mid-stream: %s", inst.id, failure)

    async def cut(
        self,
        inst: Instance,
        decision: Decision,
        ttft: float,
        failure: str,
        ctx: RequestContext,
        why: str,
    ) -> None:
        """End a stream that could not be continued with an error event saying why."""
        log.warning("stream of %s cut (%s), not continued: %s", ctx.req.model, failure, why)
        await self._cut_event(inst, decision, ttft, ctx, why)

    async def _cut_event(
        self, inst: Instance, decision: Decision, ttft: float, ctx: RequestContext, why: str
    ) -> None:
        """The engine failed after the first byte: end the stream with an error event."""
        message = "the engine failed mid-stream; the response is incomplete"
        if why:
            message += f" (not continued: {why})"
            reason = ctx.abandoned or ctx.continue_reason or "engine_lost"
            self.metrics.continuations.labels(ctx.req.model, reason, f"cut_{why}").inc()
        ctx.complete = True
        tap = ctx.tap
        if isinstance(tap, ResponsesTap):
            event = responses_error_event(message, _CUT, tap.relayed_events)
        else:
            event = sse_error_event(message, _CUT)
        await ctx.send({"type": "http.response.body", "body": event})
        self.recorder.served(ctx, decision, inst.id, 502, ttft, None, None)

    async def end_whole(self, ctx: RequestContext, cut: StreamCut, relayed: Relayed) -> None:
        """The client already has the whole answer (its finish reason, or every token it
        asked for) but not the stream's end: end it as the engine would have."""
        events = []
        if relayed.finish_reason is None:
            events.append(finish_event(ctx.req.endpoint.kind, relayed, ctx.req.model, "length"))
        if not ctx.req.strip_usage:
            events.append(
                usage_event(relayed, ctx.req.model, ctx.req.prompt_tokens, ctx.req.endpoint.kind)
            )
        events.append(b"data: [DONE]\n\n")
        ctx.complete = True
        await ctx.send({"type": "http.response.body", "body": b"".join(events)})
        self.recorder.served(ctx, cut.decision, cut.inst.id, 200, cut.ttft, None, None)

    async def remote(
        self, resp: Response, remote: Remote, why: str, connect_s: float, ctx: RequestContext
    ) -> None:
        """Pass the remote edge's answer through; its route header gains where it came from."""
        req = ctx.req
        route = remote_route(
            resp.headers.get(_ROUTE, b""), self.region, remote.code, why, remote.rtt_s
        )
        ctype = resp.headers.get(b"content-type", JSON)
        try:
            first = await resp.readany() if req.stream else await resp.read()
        except UpstreamError as exc:
            raise UpstreamFailure(f"read: {exc}", connect=True, retry=may_retry(exc)) from exc
        ttft = time.perf_counter() - ctx.arrived
        headers_out = [
            (b"content-type", ctype),
            (_ROUTE, route),
            # Spilled before any local wait counted: the remote edge reports its own.
            (b"server-timing", server_timing(0.0, connect_s, ttft)),
            (b"traceparent", ctx.traceparent.encode()),
        ]
        retry_after = resp.headers.get(b"retry-after")
        if retry_after is not None:
            headers_out.append((b"retry-after", retry_after))
        if not req.stream:
            headers_out.append((b"content-length", str(len(first)).encode()))
        ctx.sent = True
        await ctx.send(
            {"type": "http.response.start", "status": resp.status, "headers": headers_out}
        )
        if req.stream:
            status = await self._remote_stream(resp, remote, first, ctx)
        else:
            ctx.complete = True
            await ctx.send({"type": "http.response.body", "body": first})
            prompt, _, completion = body_usage(first)
            if prompt is not None and completion is not None:
                ctx.used_tokens = prompt + completion
            status = resp.status
        ctx.status = status
        self.recorder.answered(req.model, f"remote:{remote.code}", status)

    async def _remote_stream(
        self, resp: Response, remote: Remote, first: bytes, ctx: RequestContext
    ) -> int:
        """The rest of a remote edge's stream; the status to record (502 when it was cut)."""
        send = ctx.send
        await send({"type": "http.response.body", "body": first, "more_body": True})
        try:
            while True:
                chunk = await resp.readany()
                if not chunk:
                    break
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except UpstreamError as exc:
            self.metrics.midstream_failures.labels(f"remote:{remote.code}").inc()
            ctx.complete = True
            log.warning("remote region %s failed mid-stream: %s", remote.code, exc)
            message = f"region {remote.code} failed mid-stream; the response is incomplete"
            if ctx.req.endpoint.kind == "responses":
                event = responses_error_event(message, _CUT, None)
            else:
                event = sse_error_event(message, _CUT)
            await send({"type": "http.response.body", "body": event})
            return 502
        ctx.complete = True
        await send({"type": "http.response.body", "body": b""})
        return resp.status

    async def refusal(
        self, ctx: RequestContext, status: int, body: bytes, route: bytes, instance: str
    ) -> None:
        """An engine refused a leg the client did not see (4xx): its answer, passed through."""
        ctx.sent = ctx.complete = True
        ctx.status = status
        await ctx.send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [
                    (b"content-type", JSON),
                    (b"content-length", str(len(body)).encode()),
                    (_ROUTE, route),
                ],
            }
        )
        await ctx.send({"type": "http.response.body", "body": body})
        self.recorder.answered(ctx.req.model, instance, status)

    async def refuse(
        self,
        send: Send,
        err: EdgeError,
        model: str = "",
        where: str = "",
        route: bytes | None = None,
    ) -> None:
        """Record a refusal of a request for ``model`` (at instance or region ``where``, if it
        got that far) and answer it with :meth:`error`."""
        self.recorder.answered(model, where, err.status)
        await self.error(send, err, route)

    async def error(
        self, send: Send, err: EdgeError, route: bytes | None = None, extra: list[Any] | None = None
    ) -> None:
        """An OpenAI-style refusal, with ``Retry-After`` where waiting helps."""
        headers = [
            (b"content-type", JSON),
            (_ROUTE, route or route_header(self.region, None, 0, err.code)),
        ]
        if err.retry_after is not None:
            headers.append((b"retry-after", str(err.retry_after).encode()))
        if extra:
            headers.extend(extra)
        body = err.body()
        headers.append((b"content-length", str(len(body)).encode()))
        await send({"type": "http.response.start", "status": err.status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    async def no_capacity(self, ctx: RequestContext, decision: Decision) -> None:
        """No local instance can take the request (none healthy, all busy, all failed)."""
        req = ctx.req
        reason = decision.reason
        if reason == "saturated":
            msg = f"all instances of `{req.model}` are at capacity; retry later"
        elif ctx.last_failure:
            log.warning(
                "no instance of %s could serve a request (last: %s)", req.model, ctx.last_failure
            )
            msg = f"no instance of `{req.model}` could serve the request; retry later"
        else:
            msg = f"no healthy instance of `{req.model}` in region {self.region}"
        err = EdgeError(503, msg, reason, retry_after=self.retry_after_s)
        ctx.status = 503
        self.recorder.answered(req.model, "", 503)
        timing = (b"server-timing", server_timing(ctx.queue_s, None, None))
        route = route_header(self.region, None, ctx.retries, reason)
        await self.error(ctx.send, err, route, [timing])

    async def upstream_failed(self, ctx: RequestContext, decision: Decision) -> None:
        """The last instance tried failed before responding, and no other may be tried."""
        req = ctx.req
        log.warning("upstream failed before responding: %s", ctx.last_failure)
        err = EdgeError(
            502,
            f"the engine serving `{req.model}` failed before responding; retry later",
            "upstream_error",
            retry_after=self.retry_after_s,
        )
        inst = decision.winner.instance if decision.winner else ""
        ctx.status = 502
        self.recorder.answered(req.model, inst, 502)
        route = route_header(self.region, decision, ctx.retries, view=ctx.view)
        await self.error(ctx.send, err, route)
