"""The record stage: what every answered request leaves behind, in one place.

Per-request metric series (status, TTFT, end-to-end time, predicted and actual cached tokens,
prompt tokens) and, once the request is over, the settlement of the tenant's rate charge with
the tokens the engine reported and of its budget hold with the request's price (``budget.py``),
and its usage record (``metering/meter.py``) when an instance here served it — answered, cut, or
abandoned by its client.
"""

from __future__ import annotations

import time
from typing import NamedTuple

from regions.edge.metering.meter import Meter
from regions.edge.observability import EdgeMetrics
from regions.edge.policy.admission import Admission
from regions.edge.policy.budget import Budgets
from regions.edge.policy.scheduler import Decision
from regions.edge.stages.context import RequestContext
from regions.edge.view.load import LoadBoard
from regions.tables.usage import USAGE_SCHEMA_VERSION

#: Less time than this at the gateway is the decision itself, not a wait for a slot.
NO_WAIT_S = 0.001
#: The status of a request whose client left before its answer ended (nginx's convention).
CLIENT_GONE = 499


class Recorder:
    __slots__ = (
        "admission", "budgets", "learn_speeds", "loads", "meter", "metrics", "region",
    )  # fmt: skip

    def __init__(
        self,
        metrics: EdgeMetrics,
        admission: Admission,
        loads: LoadBoard,
        region: str,
        meter: Meter | None,
        budgets: Budgets,
        learn_speeds: bool = True,
    ) -> None:
        self.metrics = metrics
        self.admission = admission
        self.loads = loads
        self.region = region
        self.meter = meter
        self.budgets = budgets
        #: Learn each instance's prefill rate from streamed answers (``speed.py``).
        self.learn_speeds = learn_speeds

    def answered(self, model: str, where: str, status: int) -> None:
        """An answer with no timings: a refusal, an error, a remote region's answer."""
        self.metrics.count(model, where, status)

    def served(
        self,
        ctx: RequestContext,
        decision: Decision,
        instance: str,
        status: int,
        ttft: float | None,
        prompt: int | None,
        cached: int | None,
    ) -> None:
        """An instance's answer: its status, times and what the engine reported of the prompt
        (``prompt``/``cached`` tokens, None when it did not say). A tokenizer call's times are
        not an inference's: only its status is counted."""
        ctx.status = status
        if not ctx.req.endpoint.queued:
            statuses = self.metrics.series(ctx.req.model, instance).statuses
            statuses[status] = statuses.get(status, 0) + 1
            return
        ctx.ttft_s = ttft
        ctx.prompt_tokens = prompt
        ctx.cached_tokens = cached
        series = self.metrics.series(ctx.req.model, instance)
        statuses = series.statuses
        statuses[status] = statuses.get(status, 0) + 1
        if ttft is not None:
            series.ttft.observe(ttft)
        series.e2e.observe(time.perf_counter() - ctx.arrived)
        winner = decision.winner
        if cached is not None and winner is not None:
            series.predicted_cached += winner.cached_tokens
            series.actual_cached += cached
            if winner.instance == instance:
                series.compare(winner.exact, winner.cached_tokens, cached)
        if (
            self.learn_speeds
            and ttft is not None
            and status == 200
            and ctx.req.stream
            and ctx.req.endpoint.kind != "responses"
            and ctx.legs is None  # a continued stream's TTFT is its first engine's
            and winner is not None
            and winner.instance == instance
            and not winner.wait
            and winner.slot_s == 0.0
            and ctx.queue_s < NO_WAIT_S
            # Not behind more prefill work than its own: that line's length is an estimate
            # (what was sent, drained at the rate in use), and an error in it that grows
            # with load, taken for speed, would draw more load to the engine it flatters.
            and 2.0 * winner.ahead_s <= winner.ttft_s - winner.fixed_s
        ):
            fixed = winner.fixed_s
            self.loads.learn(instance, winner.ttft_s - fixed, ttft - fixed)
        if prompt is not None:
            series.prompt_tokens += prompt

    def finished(self, ctx: RequestContext) -> None:
        """The request is over (answered, failed or abandoned): settle the tenant's charge and
        budget hold; when an instance here answered it, or was running it when the client left,
        count its generated tokens in the instance's load (the heartbeat's tokens/s: prompt +
        output), spend its price on the budget and meter it."""
        tenant = ctx.tenant
        if ctx.charged and tenant is not None and ctx.used_tokens is not None:
            self.admission.settle(tenant, ctx.charged, ctx.used_tokens)
        cancelled = ctx.disconnected and not ctx.complete
        inst = ctx.served_by
        # An engine's refusal (4xx) is not usage; a stream cut after tokens reached the client
        # is, for what was relayed.
        relayed = ctx.relayed_before > 0 or (ctx.tap is not None and ctx.tap.relayed_tokens > 0)
        delivered = 0 < ctx.status < 400 or (ctx.status >= 500 and relayed)
        # The tokenizer's calls report no usage: not metered, nothing held.
        if inst is None or not (delivered or cancelled) or not ctx.req.endpoint.metered:
            if ctx.hold is not None:
                self.budgets.release(ctx.hold)
            return
        tokens = _tokens(ctx)
        if ctx.hold is not None:
            self.budgets.settle(
                ctx.hold, inst.model, tokens.prompt, tokens.cached, tokens.completion
            )
        self.loads.get(inst.id).tokens += tokens.completion
        meter = self.meter
        if meter is None or ctx.metered_elsewhere:
            return
        if meter.spool.full and meter.drop_when_full:  # --usage-spool-full serve
            meter.dropped += 1
            return
        # The usage record, as a row in schema 4's order (``regions/tables/usage.py``), encoded
        # with its batch (``usage_spool.py``). Built here, not in a method: metering's budget is
        # a few µs per request, and a Python call is a tenth of the row's price.
        req = ctx.req
        prompt, cached, completion, reported = tokens
        ids = meter.ids
        duration = time.perf_counter() - ctx.arrived
        ttft = ctx.ttft_s
        legs = ctx.legs
        # Legs the client's answer came from beyond the first (a try that failed before its
        # first token is no leg).
        continued = len(legs) - 1 if legs else 0
        meter.spool.append(
            (
                USAGE_SCHEMA_VERSION,
                ids.prefix,
                ids.next_seq(),
                time.time() - duration,
                self.region,
                ctx.entry_region or self.region,
                inst.id,
                inst.model,
                req.model if req.model != inst.model else None,
                tenant.slug if tenant is not None else None,
                ctx.key_prefix,
                prompt,
                cached,
                completion,
                ttft * 1000.0 if ttft is not None else None,
                duration * 1000.0,
                CLIENT_GONE if cancelled else ctx.status,
                req.stream,
                cancelled,
                reported,
                self.budgets.edge,
                continued,
                ",".join(legs) if legs and continued else None,
                ctx.continue_reason if continued else None,
                ctx.reprefill_tokens if continued else 0,
            )
        )


class Tokens(NamedTuple):
    prompt: int
    cached: int
    completion: int
    #: The engine reported them (else: the edge's own count).
    reported: bool


def _tokens(ctx: RequestContext) -> Tokens:
    """What the engine reported; without its usage report (a cut or abandoned stream), the
    prompt is the edge's count and the completion the events relayed."""
    prompt, used = ctx.prompt_tokens, ctx.used_tokens
    if prompt is not None and used is not None:
        return Tokens(prompt, min(ctx.cached_tokens or 0, prompt), used - prompt, True)
    # The role chunk that opens a chat stream carries no token; a continued stream's earlier
    # legs were counted when it was continued.
    relayed = ctx.relayed_before + (ctx.tap.relayed_tokens if ctx.tap is not None else 0)
    return Tokens(ctx.req.prompt_tokens, 0, relayed, False)
