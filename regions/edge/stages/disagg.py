"""Disaggregated prefill/decode (P/D) routing: two hops, vLLM's ``kv_transfer_params`` protocol.

When a model's local instances include ``prefill`` and ``decode`` roles, a request goes first
to a prefill instance (chosen by the expected-TTFT scheduler, prefix-cache aware) as a prefill
leg: ``max_tokens`` 1, not streamed, ``kv_transfer_params`` ``{"do_remote_decode": true, ...}``.
Its answer carries the ``kv_transfer_params`` that locate the computed KV blocks; the client's
request, with those params added, then goes to the decode instance with the least decode load
(running requests / concurrency cap), and that answer is passed to the client byte for byte.
This is what vLLM's ``toy_proxy_server.py`` does, so it works unchanged against vLLM with a KV
connector (NixlConnector and friends). Design and failure handling: ``docs/edge-scheduling.md``.

The top half is pure (plain data in, a decision out); :class:`PdRouter` is the I/O, which the
edge asks first for every request it serves locally (``app.py``); it says no at once for a
model whose instances are all ``mixed``.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import orjson

from regions.edge.config import DisaggConfig, EdgeConfig
from regions.edge.http.errors import EdgeError, UpstreamFailure
from regions.edge.http.upstream import UpstreamError
from regions.edge.policy.route import pd_route, prefill_refusal_route
from regions.edge.policy.scheduler import Candidate, Decision, Scored, serves
from regions.edge.stages.attempt import Attempt
from regions.edge.stages.context import Fleet, RequestContext
from regions.edge.stages.forward import Forwarder
from regions.edge.stages.place import Placement

#: The prefill leg's ``kv_transfer_params``, exactly as vLLM's proxies send them.
PREFILL_KV_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
#: Sampling fields a prefill leg must not carry (vLLM's proxy drops them: with ``max_tokens``
#: 1 a ``min_tokens`` above 1 is an error).
_PREFILL_DROPS = ("stream_options", "min_tokens", "min_completion_tokens")

Mode = Literal["pd", "decode_only", "none"]

log = logging.getLogger("fedinfer.edge.disagg")


@dataclass(slots=True)
class DecodePick:
    """The decode hop's choice; ``instance`` None when nothing can take it (``reason``)."""

    instance: str | None
    #: (running + waiting) / concurrency cap of the winner at decision time.
    load: float
    outstanding: int
    runner_up: str | None
    reason: str


def plan(
    candidates: Sequence[Candidate], model: str, prompt_tokens: int, cfg: DisaggConfig
) -> Mode | None:
    """How to serve a request: None leaves it to the single-hop path (no prefill or decode
    instances, or a mixed instance suits it better); ``pd`` two hops; ``decode_only`` when no
    prefill instance is usable and no mixed one exists (a decode engine can prefill itself);
    ``none`` when nothing can serve it."""
    roles: set[str] = set()
    usable: set[str] = set()
    for c in candidates:
        if not serves(c, model):
            continue
        roles.add(c.role)
        if c.state == "ready" and c.healthy:
            usable.add(c.role)
    if "prefill" not in roles and "decode" not in roles:
        return None
    if "prefill" in usable and "decode" in usable:
        if "mixed" in usable and prompt_tokens < cfg.min_prompt_tokens:
            return None
        return "pd"
    if "mixed" in usable:
        return None
    if "decode" in usable:
        return "decode_only"
    # Nothing usable: the single-hop path explains it when mixed instances exist.
    return None if "mixed" in roles else "none"


def pick_decode(
    candidates: Sequence[Candidate],
    model: str,
    exclude: frozenset[str],
    turn: int,
    cfg: DisaggConfig,
) -> DecodePick:
    """The decode instance with the least load (requests / cap); ties rotate with ``turn``.

    Decode cost is per running sequence, not per prompt token, so the prefix index and the
    prefill rate do not matter here; an instance at its cap is not a candidate, and one whose
    KV cache is full only when every other is full too.
    """
    feasible = [
        c
        for c in candidates
        if serves(c, model)
        and c.role == "decode"
        and c.state == "ready"
        and c.healthy
        and c.id not in exclude
    ]
    if not feasible:
        return DecodePick(None, 0.0, 0, None, "no_healthy_instance")
    free = [c for c in feasible if c.inflight < c.max_concurrency]
    if not free:
        return DecodePick(None, 0.0, 0, None, "saturated")
    roomy = [c for c in free if c.kv_usage < cfg.kv_full] or free
    start = turn % len(roomy)
    order = roomy[start:] + roomy[:start]

    def load(c: Candidate) -> float:
        return (max(c.outstanding, c.inflight) + c.queued) / c.max_concurrency

    order.sort(key=load)  # stable: equal loads keep the rotated order
    best = order[0]
    runner_up = order[1].id if len(order) > 1 else None
    return DecodePick(best.id, load(best), best.outstanding, runner_up, "least_decode_load")


def prefill_body(body: bytes) -> bytes:
    """The prefill leg: the client's request, one token, not streamed, asking to keep the KV."""
    data = orjson.loads(body)
    data["kv_transfer_params"] = PREFILL_KV_PARAMS
    data["stream"] = False
    data["max_tokens"] = 1
    if "max_completion_tokens" in data:
        data["max_completion_tokens"] = 1
    for key in _PREFILL_DROPS:
        data.pop(key, None)
    return orjson.dumps(data)


def decode_body(body: bytes, params: dict[str, Any]) -> bytes:
    """The decode leg: the client's request plus the prefill engine's ``kv_transfer_params``."""
    data = orjson.loads(body)
    data["kv_transfer_params"] = params
    return orjson.dumps(data)


def response_params(body: bytes) -> dict[str, Any] | None:
    """``kv_transfer_params`` of a prefill leg's answer (None: the engine returned none, e.g.
    it has no KV connector or the one token was end-of-sequence)."""
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    params = data.get("kv_transfer_params") if isinstance(data, dict) else None
    return params if isinstance(params, dict) and params else None


# ------------------------------------------------------------------------------------ I/O


class _PrefillFailed(Exception):
    """The prefill leg failed before anything reached the client (retry or fall back)."""


@dataclass(slots=True)
class _TwoHops:
    """What the prefill hop hands the decode hop."""

    mode: Mode
    #: Both legs carry it (``x-request-id``): the engines' KV connector pairs them by it.
    request_id: str
    #: The prefill engine's ``kv_transfer_params`` (None: nothing to transfer).
    params: dict[str, Any] | None = None
    prefill: Scored | None = None
    prefill_s: float = 0.0
    #: Why the prefill hop failed, for the route header.
    note: str = ""
    retries: int = 0
    queue_s: float = 0.0


class PdRouter:
    """Serves a request in two hops when :func:`plan` says so."""

    __slots__ = ("attempts", "cfg", "fleet", "forwarder", "placement", "relay")

    def __init__(
        self, cfg: EdgeConfig, fleet: Fleet, placement: Placement, forwarder: Forwarder
    ) -> None:
        self.cfg = cfg
        self.fleet = fleet
        self.placement = placement
        self.forwarder = forwarder
        self.attempts = forwarder.attempts
        self.relay = forwarder.relay

    async def serve(self, ctx: RequestContext) -> bool:
        """Serve ``ctx`` in two hops when :func:`plan` says so; False (nothing sent) to leave
        it to the single-hop path, including after every prefill instance failed and a mixed
        instance exists."""
        req = ctx.req
        if all(inst.role == "mixed" for inst in self.fleet.by_model.get(req.model, ())):
            return False  # the common case, decided without building candidates
        candidates = self.placement.candidates(
            req.model, ctx.hashes, time.monotonic(), tokens=ctx.tokens
        )
        mode = plan(candidates, req.model, req.prompt_tokens, self.cfg.disagg)
        if mode is None:
            return False
        hops = _TwoHops(mode, f"fedinfer-{uuid.uuid4().hex}")
        if mode == "pd":
            if await self._prefill_hop(hops, ctx):
                return True
            if hops.prefill is None and self._has_usable_mixed(req.model):
                return False  # every prefill instance failed: the mixed instances serve it
        if hops.prefill is not None and ctx.view is not None:
            hops.prefill = ctx.view.shown(hops.prefill)  # only the cache its prompts made
        await self._decode_hop(hops, ctx)
        return True

    async def _prefill_hop(self, hops: _TwoHops, ctx: RequestContext) -> bool:
        """Prefill on the best prefill instance, retried elsewhere; True when that answered
        the client already (a refusal)."""
        exclude: frozenset[str] = frozenset()
        body = prefill_body(ctx.req.body)
        while hops.retries <= self.cfg.max_retries:
            # The prefill instances' own gateway line: bounded, first come first served.
            decision, waited = await self.placement.place(ctx, None, exclude, role="prefill")
            hops.queue_s += waited
            winner = decision.winner
            if winner is None and decision.reason == "saturated":
                # Every prefill slot busy past the queue timeout: pushing prefills onto the
                # decode engines would slow every running stream, so refuse like single-hop.
                ctx.complete = True
                ctx.retries, ctx.queue_s, ctx.last_failure = hops.retries, hops.queue_s, hops.note
                await self.relay.no_capacity(ctx, decision)
                return True
            if winner is None:
                hops.note = hops.note or decision.reason
                return False
            t0 = time.perf_counter()
            try:
                hops.params = await self._prefill(winner, body, hops.request_id, ctx)
            except _PrefillFailed as failure:
                hops.note = f"{winner.instance}:{failure}".replace(";", ",")
                exclude = exclude | {winner.instance}
                hops.retries += 1
                continue
            if ctx.sent:
                return True  # the prefill engine refused the request (4xx): relayed as is
            hops.prefill, hops.prefill_s, hops.note = winner, time.perf_counter() - t0, ""
            return False
        return False

    def _has_usable_mixed(self, model: str) -> bool:
        states = self.attempts.health.states
        for inst in self.fleet.by_model.get(model, ()):
            health = states.get(inst.id)
            if inst.role == "mixed" and inst.state == "ready" and health and health.healthy:
                return True
        return False

    async def _prefill(
        self, winner: Scored, body: bytes, request_id: str, ctx: RequestContext
    ) -> dict[str, Any] | None:
        """Run the prefill leg on ``winner``; its ``kv_transfer_params``. A 4xx answer is the
        client's problem: it is relayed (``ctx.sent``) and None returned."""
        trace = ctx.trace
        if trace is None:
            return await self._prefill_leg(winner, body, request_id, ctx, ctx.traceparent)
        with trace.leg("edge.pd.prefill", winner.instance) as hop:
            params = await self._prefill_leg(winner, body, request_id, ctx, hop.traceparent)
            hop.span.set_attribute("fedinfer.kv_transferred", params is not None)
            return params

    async def _prefill_leg(
        self, winner: Scored, body: bytes, request_id: str, ctx: RequestContext, traceparent: str
    ) -> dict[str, Any] | None:
        req = ctx.req
        inst = self.fleet.instances[winner.instance]
        health = self.attempts.health
        headers = [
            (b"traceparent", traceparent.encode()),
            (b"x-request-id", request_id.encode()),
        ]
        uncached = req.prompt_tokens - winner.cached_tokens
        with Attempt(self.attempts, inst, req.prompt_tokens, uncached) as attempt:
            attempt.reached = False
            # after this leg the prefill engine holds the prompt's blocks
            self.placement.sent(ctx, inst)
            try:
                resp = await self.fleet.upstream.post(inst.url, req.path, body, headers)
            except UpstreamError as exc:
                health.connect_error(inst.id, str(exc))
                raise _PrefillFailed(str(exc)) from exc
            attempt.reached = True
            try:
                data = await resp.read()
            except UpstreamError as exc:
                health.connect_error(inst.id, f"read: {exc}")
                raise _PrefillFailed(f"read: {exc}") from exc
            finally:
                # Pooled again when read in full; closed otherwise (a failure, or the client
                # gone: closing is how the engine learns to abort).
                resp.release()
            if resp.status >= 500:
                health.failure(inst.id, f"status {resp.status}")
                raise _PrefillFailed(f"status {resp.status}")
            if resp.status != 200:
                route = prefill_refusal_route(self.cfg.region, inst.id, resp.status)
                await self.relay.refusal(ctx, resp.status, data, route, inst.id)
                return None
            health.success(inst.id)
            return response_params(data)

    async def _decode_hop(self, hops: _TwoHops, ctx: RequestContext) -> None:
        """The decode hop, retried on another decode instance while nothing reached the client."""
        req = ctx.req
        cfg = self.cfg
        params = hops.params
        body = decode_body(req.body, params) if params is not None else req.body
        kv = "transferred" if params is not None else "none"
        # What the decode engine should report as cached: everything but the last prompt token.
        expected_cached = max(0, req.prompt_tokens - 1) if params is not None else 0
        exclude: frozenset[str] = frozenset()
        started_wait = time.monotonic()
        decode_retries = 0
        while True:
            pick = await self._pick(req.model, exclude, started_wait)
            if pick.instance is None:
                err = EdgeError(
                    503,
                    f"no decode instance of `{req.model}` can take the request ({pick.reason})",
                    pick.reason,
                    retry_after=cfg.retry_after_s,
                )
                await self._refuse(err, "", self._route(pick, kv, hops, hops.retries), ctx)
                return
            inst = self.fleet.instances[pick.instance]
            hops.queue_s += time.monotonic() - started_wait
            route = self._route(pick, kv, hops, hops.retries + decode_retries)
            ctx.queue_s, ctx.route = hops.queue_s, route
            ctx.uncontinuable = "prefill_decode"  # its KV came from a prefill engine
            ctx.timing_extra = f", prefill;dur={hops.prefill_s * 1000:.2f}".encode()
            scored = Scored(inst.id, 0.0, hops.queue_s, 0.0, expected_cached, pick.outstanding)
            uncached = req.prompt_tokens - expected_cached
            with Attempt(self.attempts, inst, req.prompt_tokens, uncached) as attempt:
                try:
                    # The single-hop relay, with both hops in the route header and timings.
                    await self.forwarder.forward(
                        inst,
                        Decision(scored, None, "pd_decode"),
                        ctx,
                        body,
                        ((b"x-request-id", hops.request_id.encode()),),
                        "edge.pd.decode",
                    )
                    return
                except UpstreamFailure as failure:
                    attempt.failed(failure)
                    if decode_retries >= cfg.max_retries or not failure.retry:
                        log.warning("decode leg on %s failed: %s", inst.id, failure.reason)
                        err = EdgeError(
                            502,
                            "decode engines failed before responding; retry later",
                            "upstream_error",
                            retry_after=cfg.retry_after_s,
                        )
                        await self._refuse(err, inst.id, route, ctx)
                        return
                    decode_retries += 1
                    exclude = exclude | {inst.id}
                    started_wait = time.monotonic()

    async def _pick(self, model: str, exclude: frozenset[str], since: float) -> DecodePick:
        """The decode instance to try; while every one is at its cap, decided again every
        ``wait_poll_s`` until the queue timeout (counted from ``since``)."""
        placement = self.placement
        while True:
            candidates = placement.candidates(model, (), time.monotonic())
            pick = pick_decode(candidates, model, exclude, placement.turn, self.cfg.disagg)
            placement.turn += 1
            if (
                pick.instance is not None
                or pick.reason != "saturated"
                or time.monotonic() - since >= self.cfg.queue_timeout_s
            ):
                return pick
            await asyncio.sleep(self.cfg.disagg.wait_poll_s)

    async def _refuse(
        self, err: EdgeError, instance: str, route: bytes, ctx: RequestContext
    ) -> None:
        ctx.complete = True
        ctx.status = err.status
        await self.relay.refuse(ctx.send, err, ctx.req.model, instance, route)

    def _route(self, pick: DecodePick, kv: str, hops: _TwoHops, retries: int) -> bytes:
        return pd_route(self.cfg.region, hops.mode, hops.prefill, hops.note, pick, kv, retries)
