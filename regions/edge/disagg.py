"""Disaggregated prefill/decode (P/D) routing: two hops, vLLM's ``kv_transfer_params`` protocol.

When a model's local instances include ``prefill`` and ``decode`` roles, a request goes first
to a prefill instance (chosen by the expected-TTFT scheduler, prefix-cache aware) as a prefill
leg: ``max_tokens`` 1, not streamed, ``kv_transfer_params`` ``{"do_remote_decode": true, ...}``.
Its answer carries the ``kv_transfer_params`` that locate the computed KV blocks; the client's
request, with those params added, then goes to the decode instance with the least decode load
(running requests / concurrency cap), and that answer is passed to the client byte for byte.
This is what vLLM's ``toy_proxy_server.py`` does, so it works unchanged against vLLM with a KV
connector (NixlConnector and friends). Design and failure handling: ``docs/edge-scheduling.md``.

The top half is pure (plain data in, a decision out); :func:`serve` is the I/O, called from a
small hook in ``app.py``'s ``_route_and_forward``.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Literal

import orjson

from regions.edge.attempt import Attempt
from regions.edge.errors import EdgeError, UpstreamFailure
from regions.edge.parse import ParsedRequest
from regions.edge.scheduler import Candidate, Decision, Scored, serves
from regions.edge.upstream import UpstreamError

if TYPE_CHECKING:
    from regions.edge.app import Edge, Send, _Exchange

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


@dataclass(frozen=True, slots=True)
class DisaggConfig:
    #: With mixed instances as well, shorter prompts go to them: the extra hop and the KV
    #: transfer cost more than a short prefill interferes with decodes.
    min_prompt_tokens: int = 256
    #: KV usage from which a decode instance is passed over while another has room.
    kv_full: float = 0.95
    #: How often a request re-decides while every candidate of a hop is at its cap.
    wait_poll_s: float = 0.02


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


def route_text(
    region: str,
    mode: Mode,
    prefill: Scored | None,
    prefill_note: str,
    decode: DecodePick,
    kv: str,
    retries: int,
) -> bytes:
    """``x-fedinfer-route`` of a P/D request: both hops and why, e.g. ``region=r;mode=pd;
    prefill=p-1;score=ttft_ms:..;decode=d-2;decode_load=0.125;kv=transferred;retries=0``."""
    text = f"region={region};mode={mode}"
    if prefill is not None:
        text += (
            f";prefill={prefill.instance};score=ttft_ms:{prefill.ttft_s * 1000:.1f},queue_ms:"
            f"{prefill.queue_s * 1000:.1f},prefill_ms:{prefill.prefill_s * 1000:.1f},cached:"
            f"{prefill.cached_tokens}"
        )
    else:
        text += ";prefill=none"
    if prefill_note:
        text += f";prefill_failed={prefill_note}"
    text += f";decode={decode.instance or 'none'};decode_load={decode.load:.3f}"
    if decode.runner_up is not None:
        text += f";decode_runner_up={decode.runner_up}"
    return f"{text};kv={kv};retries={retries}".encode("latin-1")


# ------------------------------------------------------------------------------------ I/O


class _PrefillFailed(Exception):
    """The prefill leg failed before anything reached the client (retry or fall back)."""


async def serve(
    edge: Edge,
    req: ParsedRequest,
    hashes: list[int],
    traceparent: str,
    arrived: float,
    ex: _Exchange,
    send: Send,
    cfg: DisaggConfig | None = None,
) -> bool:
    """Serve ``req`` in two hops when :func:`plan` says so; False (nothing sent) to leave it
    to the single-hop path, including after every prefill instance failed and a mixed
    instance exists."""
    if all(inst.role == "mixed" for inst in edge.by_model.get(req.model, ())):
        return False  # the common case, decided without building candidates
    cfg = cfg or DisaggConfig()
    now = time.monotonic()
    mode = plan(edge._candidates(req.model, hashes, now), req.model, req.prompt_tokens, cfg)
    if mode is None:
        return False
    request_id = f"fedinfer-{uuid.uuid4().hex}"
    retries = 0
    queue_s = 0.0
    params: dict[str, Any] | None = None
    prefill: Scored | None = None
    prefill_s = 0.0
    note = ""
    if mode == "pd":
        exclude: frozenset[str] = frozenset()
        body = prefill_body(req.body)
        while retries <= edge.cfg.max_retries:
            # The prefill instances' own gateway line: bounded, first come first served.
            decision, waited = await edge._decide(req, hashes, None, exclude, role="prefill")
            queue_s += waited
            winner = decision.winner
            if winner is None and decision.reason == "saturated":
                # Every prefill slot busy past the queue timeout: pushing prefills onto the
                # decode engines would slow every running stream, so refuse like single-hop.
                ex.complete = True
                await edge._no_capacity(send, req, decision, retries, queue_s, note)
                return True
            if winner is None:
                note = note or decision.reason
                break
            t0 = time.perf_counter()
            try:
                params = await _prefill(
                    edge, winner, req, hashes, body, traceparent, request_id, send, ex
                )
            except _PrefillFailed as failure:
                note = f"{winner.instance}:{failure}".replace(";", ",")
                exclude = exclude | {winner.instance}
                retries += 1
                continue
            if ex.sent:
                return True  # the prefill engine refused the request (4xx): relayed as is
            prefill, prefill_s, note = winner, time.perf_counter() - t0, ""
            break
        if prefill is None and _has_usable_mixed(edge, req.model):
            return False  # every prefill instance failed: the mixed instances serve it
    if prefill is not None and ex.view is not None:
        prefill = ex.view.shown(prefill)  # the tenant sees only the cache its prompts made
    return await _decode(
        edge,
        mode,
        req,
        params,
        prefill,
        prefill_s,
        note,
        request_id,
        retries,
        queue_s,
        traceparent,
        arrived,
        ex,
        send,
        cfg,
    )


def _has_usable_mixed(edge: Edge, model: str) -> bool:
    states = edge.health.states
    for inst in edge.by_model.get(model, ()):
        health = states.get(inst.id)
        if inst.role == "mixed" and inst.state == "ready" and health and health.healthy:
            return True
    return False


async def _prefill(
    edge: Edge,
    winner: Scored,
    req: ParsedRequest,
    hashes: list[int],
    body: bytes,
    traceparent: str,
    request_id: str,
    send: Send,
    ex: _Exchange,
) -> dict[str, Any] | None:
    """Run the prefill leg on ``winner``; its ``kv_transfer_params``. A 4xx answer is the
    client's problem: it is relayed (``ex.sent``) and None returned."""
    assert edge._http is not None, "edge not started"
    inst = edge.instances[winner.instance]
    headers = [(b"traceparent", traceparent.encode()), (b"x-request-id", request_id.encode())]
    uncached = req.prompt_tokens - winner.cached_tokens
    with Attempt(edge, inst, req.prompt_tokens, uncached) as attempt:
        attempt.reached = False
        if hashes:  # after this leg the prefill engine holds the prompt's blocks
            edge.prefix.insert(hashes, inst.id, time.monotonic())
        try:
            resp = await edge._http.post(inst.url, _path(req), body, headers)
        except UpstreamError as exc:
            edge.health.connect_error(inst.id, str(exc))
            raise _PrefillFailed(str(exc)) from exc
        attempt.reached = True
        try:
            data = await resp.read()
        except UpstreamError as exc:
            edge.health.connect_error(inst.id, f"read: {exc}")
            raise _PrefillFailed(f"read: {exc}") from exc
        finally:
            # Pooled again when read in full; closed otherwise (a failure, or the client gone:
            # closing is how the engine learns to abort).
            resp.release()
        if resp.status >= 500:
            edge.health.failure(inst.id, f"status {resp.status}")
            raise _PrefillFailed(f"status {resp.status}")
        if resp.status != 200:
            await _relay_refusal(edge, req, inst.id, resp.status, data, send, ex)
            return None
        edge.health.success(inst.id)
        return response_params(data)


async def _relay_refusal(
    edge: Edge,
    req: ParsedRequest,
    inst_id: str,
    status: int,
    data: bytes,
    send: Send,
    ex: _Exchange,
) -> None:
    route = f"region={edge.cfg.region};mode=pd;prefill={inst_id};decode=none;status={status}"
    ex.sent = ex.complete = True
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(data)).encode()),
                (b"x-fedinfer-route", route.encode("latin-1")),
            ],
        }
    )
    await send({"type": "http.response.body", "body": data})
    edge.metrics.count(req.model, inst_id, status)


async def _decode(
    edge: Edge,
    mode: Mode,
    req: ParsedRequest,
    params: dict[str, Any] | None,
    prefill: Scored | None,
    prefill_s: float,
    note: str,
    request_id: str,
    retries: int,
    queue_s: float,
    traceparent: str,
    arrived: float,
    ex: _Exchange,
    send: Send,
    cfg: DisaggConfig,
) -> bool:
    """The decode hop, retried on another decode instance while nothing reached the client."""

    assert edge._http is not None, "edge not started"
    body = decode_body(req.body, params) if params is not None else req.body
    leg = replace(req, body=body)
    kv = "transferred" if params is not None else "none"
    # What the decode engine should report as cached: everything but the last prompt token.
    expected_cached = max(0, req.prompt_tokens - 1) if params is not None else 0
    exclude: frozenset[str] = frozenset()
    started_wait = time.monotonic()
    decode_retries = 0
    while True:
        pick = pick_decode(
            edge._candidates(req.model, [], time.monotonic()), req.model, exclude, edge.turn, cfg
        )
        edge.turn += 1
        if pick.instance is None:
            if (
                pick.reason == "saturated"
                and time.monotonic() - started_wait < edge.cfg.queue_timeout_s
            ):
                await asyncio.sleep(cfg.wait_poll_s)
                continue
            ex.complete = True
            err = EdgeError(
                503,
                f"no decode instance of `{req.model}` can take the request ({pick.reason})",
                pick.reason,
                retry_after=edge.cfg.retry_after_s,
            )
            edge.metrics.count(req.model, "", 503)
            route = route_text(edge.cfg.region, mode, prefill, note, pick, kv, retries)
            await edge._error(send, err, route)
            return True
        inst = edge.instances[pick.instance]
        queue_s += time.monotonic() - started_wait
        route = route_text(edge.cfg.region, mode, prefill, note, pick, kv, retries + decode_retries)
        timing_extra = f", prefill;dur={prefill_s * 1000:.2f}".encode()
        decision = Decision(
            Scored(inst.id, 0.0, queue_s, 0.0, expected_cached, pick.outstanding),
            None,
            "pd_decode",
        )
        uncached = req.prompt_tokens - expected_cached
        with Attempt(edge, inst, req.prompt_tokens, uncached) as attempt:
            try:
                # The single-hop relay, with both hops in the route header and timings.
                await edge._forward(
                    inst,
                    leg,
                    decision,
                    0,
                    traceparent,
                    arrived,
                    queue_s,
                    ex,
                    send,
                    route=route,
                    timing_extra=timing_extra,
                    upstream_headers=((b"x-request-id", request_id.encode()),),
                )
                return True
            except UpstreamFailure as failure:
                attempt.failed(failure)
                if decode_retries >= edge.cfg.max_retries or not failure.retry:
                    ex.complete = True
                    log.warning("decode leg on %s failed: %s", inst.id, failure.reason)
                    err = EdgeError(
                        502,
                        "decode engines failed before responding; retry later",
                        "upstream_error",
                        retry_after=edge.cfg.retry_after_s,
                    )
                    edge.metrics.count(req.model, inst.id, 502)
                    await edge._error(send, err, route)
                    return True
                decode_retries += 1
                exclude = exclude | {inst.id}
                started_wait = time.monotonic()


def _path(req: ParsedRequest) -> str:
    return "/v1/chat/completions" if req.chat else "/v1/completions"
