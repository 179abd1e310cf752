"""The place stage: which instance takes a request, waiting at the gateway while none can.

:meth:`Placement.candidates` gathers plain data (the table's instances, health, live load,
prefix-index matches, waiters) for the pure :func:`regions.edge.policy.scheduler.decide`;
:meth:`Placement.place` decides, and while the choice has no free slot waits in the model's
gateway line (``gateway_line.py``) and decides again.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

import xxhash

from regions.edge.config import EdgeConfig
from regions.edge.observability import CacheView
from regions.edge.policy.prefix_index import PrefixIndex, SeenPrefixes, block_hashes, root_seed
from regions.edge.policy.scheduler import Candidate, Decision, RouteRequest, decide, decide_unqueued
from regions.edge.policy.spill import Spill, eligible_remotes
from regions.edge.policy.split import SplitCounts, planned_remote, split_point
from regions.edge.stages.context import Fleet, RequestContext
from regions.edge.stages.gateway_line import GatewayLines, Waiter, blocked, line_key
from regions.edge.view.health import HealthBoard
from regions.edge.view.load import LoadBoard
from regions.edge.view.peer_sync import PeerSync
from regions.edge.view.token_prefix import MAX_PENDING, PromptTokens, TokenPrefixes
from regions.tables.schema import Instance

#: Every slot taken past the queue timeout, or the gateway full.
SATURATED = Decision(None, None, "saturated")
#: Forward to another region instead (the request's ``spill.targets``).
SPILL = Decision(None, None, "spill")


class Placement:
    """Decisions for one edge; ``turn`` rotates ties between equal instances."""

    __slots__ = (
        "_seeds",
        "block_tokens",
        "cfg",
        "fleet",
        "health",
        "lines",
        "loads",
        "peers",
        "prefix",
        "seen",
        "splits",
        "tokens",
        "turn",
    )

    def __init__(
        self,
        cfg: EdgeConfig,
        fleet: Fleet,
        health: HealthBoard,
        loads: LoadBoard,
        prefix: PrefixIndex,
        lines: GatewayLines,
        tokens: TokenPrefixes | None = None,
        peers: PeerSync | None = None,
    ) -> None:
        self.cfg = cfg
        self.fleet = fleet
        self.health = health
        self.loads = loads
        self.prefix = prefix
        self.lines = lines
        self.seen = SeenPrefixes(cfg.prefix_capacity)
        self.block_tokens = cfg.block_bytes / cfg.bytes_per_token
        self.turn = 0
        self._seeds: dict[str, int] = {}
        self.splits = SplitCounts()
        #: Exact prefixes for the models with a tokenizer (None: none configured).
        self.tokens = tokens
        #: The region's other edges, told of every prompt placed on the byte estimate and
        #: every session placed anew (None: no peer sync).
        self.peers = peers

    def hash_prompt(self, ctx: RequestContext) -> None:
        """The prompt's block hashes, and what its tenant may be shown of the cache."""
        req = ctx.req
        model = req.model
        seed = self._seeds.get(model)
        if seed is None:
            seed = self._seeds[model] = root_seed(model)
        if req.cache_salt is not None:
            # The engine shares salted blocks only with the same salt: so does the index.
            seed = xxhash.xxh3_64_intdigest(req.cache_salt.encode(), seed=seed)
        hashes = ctx.hashes = block_hashes(req.prompt, seed, self.cfg.block_bytes)
        if ctx.salt is not None:
            # Show a tenant only the cache its own prompts made (never what others sent).
            own = self.seen.depth(hashes, ctx.salt) if hashes else 0
            if hashes:
                self.seen.add(hashes, ctx.salt)
            ctx.view = CacheView(int(own * self.block_tokens), self.fleet.prefill_rates)

    async def tokenize(self, ctx: RequestContext) -> None:
        """The prompt's tokens and block hashes (``token_prefix.py``), computed in a worker
        thread, when the model has a tokenizer and an instance's KV events are followed."""
        exact = self.tokens
        req = ctx.req
        if exact is None or req.doc is None or not exact.wants(req.model, req.endpoint.kind):
            return
        sizes = exact.block_sizes(self.fleet.by_model.get(req.model, ()))
        if not sizes:
            return  # no instance's cache is known: the estimate decides anyway
        if exact.pending >= MAX_PENDING:
            exact.skipped.labels(req.model).inc()
            return  # the tokenizer is behind: place on the estimate rather than wait
        exact.pending += 1
        try:
            tokens = ctx.tokens = await asyncio.get_running_loop().run_in_executor(
                exact.worker,
                exact.prompt,
                req.model,
                req.endpoint.kind,
                req.doc,
                req.cache_salt,
                sizes,
            )
        finally:
            exact.pending -= 1
        if tokens is not None and tokens.complete:
            req.prompt_tokens = len(tokens.ids)  # the engine's count, not an estimate

    def candidates(
        self,
        model: str,
        hashes: Sequence[int],
        now: float,
        own_target: str | None = None,
        tokens: PromptTokens | None = None,
    ) -> list[Candidate]:
        """Every local instance of ``model`` as the scheduler sees it now; ``own_target``: the
        instance a re-deciding waiter targets (it does not count itself in that line);
        ``tokens``: the prompt's tokens, matched exactly where an engine's events allow."""
        mono = time.monotonic()
        matched = self.prefix.match(hashes, mono) if hashes else {}
        exact = self.tokens if tokens is not None else None
        recent: dict[int, dict[str, int]] = {}
        out = []
        states = self.health.states
        targeted = self.lines.targeted
        for inst in self.fleet.by_model[model]:
            load = self.loads.get(inst.id)
            rate = inst.prefill_tokens_per_s * load.speed
            outstanding, waiting, kv = load.snapshot()
            health = states.get(inst.id)
            out.append(
                Candidate(
                    id=inst.id,
                    model=inst.model,
                    adapters=inst.adapters,
                    role=inst.role,
                    state=inst.state,
                    healthy=health is not None and health.healthy,
                    max_concurrency=inst.max_concurrency,
                    prefill_tokens_per_s=rate,
                    inflight=load.inflight + load.peer_inflight,
                    outstanding=outstanding,
                    waiting=waiting,
                    kv_usage=kv,
                    pending_tokens=load.pending(now, rate),
                    mean_uncached_tokens=load.mean_uncached_tokens,
                    mean_service_s=load.mean_service_s,
                    cached_blocks=matched.get(inst.id, 0),
                    cached_tokens=(
                        exact.cached_tokens(tokens, inst, mono, recent)
                        if exact is not None and tokens is not None and inst.model == model
                        else None
                    ),
                    queued=targeted.get(inst.id, 0) - (inst.id == own_target),
                    full_step_s=self.loads.full_step(inst.id),
                )
            )
        return out

    def sent(self, ctx: RequestContext, inst: Instance) -> None:
        """The prompt goes to ``inst``: after its prefill the engine holds its blocks (as
        SGLang does, speculatively); the KV events confirm or correct it. A prompt placed on
        the estimate is also told to the region's other edges (peer sync)."""
        if ctx.hashes:
            self.prefix.insert(ctx.hashes, inst.id, time.monotonic())
            if self.peers is not None and ctx.tokens is None:
                self.peers.sent(inst.id, ctx.hashes)
        if ctx.tokens is not None and self.tokens is not None:
            self.tokens.sent(ctx.tokens, inst)

    def place_unqueued(self, model: str, exclude: frozenset[str]) -> Decision:
        """An instance for a call that takes no slot and never waits (``scheduler.py``,
        :func:`~regions.edge.policy.scheduler.decide_unqueued`)."""
        self.turn += 1
        return decide_unqueued(
            self.candidates(model, (), time.monotonic()), model, exclude, self.turn
        )

    async def place(
        self,
        ctx: RequestContext,
        sticky: str | None,
        exclude: frozenset[str],
        spill: Spill | None = None,
        role: str = "mixed",
    ) -> tuple[Decision, float]:
        """:meth:`decide_and_wait`, with its span when the request is traced."""
        trace = ctx.trace
        if trace is None:
            return await self.decide_and_wait(ctx, sticky, exclude, spill, role)
        started = time.perf_counter()
        decision, waited = await self.decide_and_wait(ctx, sticky, exclude, spill, role)
        trace.scheduled(started, role, decision, waited)
        return decision, waited

    async def decide_and_wait(
        self,
        ctx: RequestContext,
        sticky: str | None,
        exclude: frozenset[str],
        spill: Spill | None = None,
        role: str = "mixed",
    ) -> tuple[Decision, float]:
        """Decide; wait at the gateway (bounded queue, deadline) while the choice has no slot.
        Returns the decision and the seconds waited.

        ``role``: which instances may take it (``prefill`` for the first hop of a
        disaggregated request, disagg.py); each role of a model has its own line.

        With ``spill`` (remote regions serve the model), the first decision also says whether
        to forward instead: the local expected queue wait exceeds a remote's RTT (+ margin), or
        nothing local can take the request. Then :data:`SPILL` is returned and
        ``spill.targets``/``spill.why`` are set (one decision, not a second one to peek).
        """
        req = ctx.req
        route = RouteRequest(
            model=req.model,
            prompt_tokens=req.prompt_tokens,
            block_tokens=self.block_tokens,
            sticky=sticky,
            role=role,
            exclude=exclude,
            session=ctx.session_key,
        )
        started = time.monotonic()
        lines = self.lines
        line = lines.line(line_key(req.model, role))
        waiter: Waiter | None = None
        try:
            while True:
                now = time.monotonic()
                decision = self._decide(ctx, route, now, waiter)
                if spill is not None:
                    if self._spills(spill, decision, req.model, sticky):
                        return SPILL, now - started
                    spill = None
                target: str | None
                winner = decision.winner
                if winner is not None:
                    target = winner.instance
                    if not winner.wait and not blocked(line, target, waiter):
                        return decision, now - started
                elif decision.reason == "saturated":
                    target = None  # any slot of the model (hard-cap policies)
                else:
                    return decision, now - started
                if waiter is None:
                    waiter = lines.join(line)
                    if waiter is None:
                        return SATURATED, now - started
                remaining = started + self.cfg.queue_timeout_s - now
                if not await lines.wait(line, waiter, target, remaining):
                    return SATURATED, now - started
        finally:
            if waiter is not None:
                lines.leave(line, waiter)

    def _decide(
        self, ctx: RequestContext, route: RouteRequest, now: float, waiter: Waiter | None
    ) -> Decision:
        self.turn += 1
        own = waiter.target if waiter is not None else None
        candidates = self.candidates(route.model, ctx.hashes, now, own, ctx.tokens)
        return decide(candidates, route, self.cfg.scheduler, self.turn)

    def _spills(self, spill: Spill, decision: Decision, model: str, sticky: str | None) -> bool:
        """Does the plan send this new session elsewhere (split.py), would a remote region
        answer sooner, or is it the only option? Sets its targets."""
        winner = decision.winner
        split = spill.split
        if split is not None and winner is not None and sticky is None:
            remote = planned_remote(
                split,
                split_point(spill.point),
                spill.point,
                spill.allowed,
                winner.queue_s,
                self.cfg.split_margin_s,
            )
            if remote is not None:
                self.splits.count(model, remote.code)
                spill.targets = [remote]
                spill.why = "split"
                return True
        spill.targets = eligible_remotes(
            spill.remotes,
            spill.allowed,
            winner.queue_s if winner is not None else None,
            self.cfg.spill_margin_s,
            spill.point,
        )
        if split is not None and winner is not None and sticky is None:
            self.splits.count(model, spill.targets[0].code if spill.targets else self.cfg.region)
        if not spill.targets:
            return False
        spill.why = "ttft" if winner is not None else decision.reason
        spill.overflow = True
        return True
