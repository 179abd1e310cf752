"""The record stage: what every answered request leaves behind, in one place.

Per-request metric series (status, TTFT, end-to-end time, predicted and actual cached tokens,
prompt tokens) and, once the request is over, the settlement of the tenant's rate charge with
the tokens the engine reported. Usage metering hooks in here.
"""

from __future__ import annotations

import time

from regions.edge.admission import Admission
from regions.edge.context import RequestContext
from regions.edge.observability import EdgeMetrics
from regions.edge.scheduler import Decision


class Recorder:
    __slots__ = ("admission", "metrics")

    def __init__(self, metrics: EdgeMetrics, admission: Admission) -> None:
        self.metrics = metrics
        self.admission = admission

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
        (``prompt``/``cached`` tokens, None when it did not say)."""
        series = self.metrics.series(ctx.req.model, instance)
        statuses = series.statuses
        statuses[status] = statuses.get(status, 0) + 1
        if ttft is not None:
            series.ttft.observe(ttft)
        series.e2e.observe(time.perf_counter() - ctx.arrived)
        if cached is not None and decision.winner is not None:
            series.predicted_cached += decision.winner.cached_tokens
            series.actual_cached += cached
        if prompt is not None:
            series.prompt_tokens += prompt

    def finished(self, ctx: RequestContext) -> None:
        """The request is over (answered, failed or abandoned): settle the tenant's charge."""
        tenant = ctx.tenant
        if ctx.charged and tenant is not None and ctx.used_tokens is not None:
            self.admission.settle(tenant, ctx.charged, ctx.used_tokens)
