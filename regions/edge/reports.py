"""What the edge says about itself: the heartbeat document the control plane receives
(``docs/distribution.md``) and ``/healthz``'s, what the scheduler believes of every instance.
Read-only views of the edge's boards; the heartbeat keeps only what its rates are measured
from."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from regions.edge.policy.spill import overflow_shares

if TYPE_CHECKING:
    from regions.edge.app import Edge


class Heartbeats:
    """Heartbeat v1 documents: applied version, health and load, and what this edge has
    committed of the budgets it holds leases of."""

    __slots__ = ("at", "cold_reported", "tokens")

    def __init__(self) -> None:
        #: The last beat's time and prompt-token totals per instance (the rates' baseline).
        self.at = time.monotonic()
        self.tokens: dict[str, int] = {}
        #: Whether the last beat listed cold models (one more beat clears their demand).
        self.cold_reported = False

    def document(self, edge: Edge) -> dict[str, Any]:
        now = time.monotonic()
        elapsed = max(now - self.at, 1e-3)
        self.at = now
        previous = self.tokens
        tokens: dict[str, int] = {}
        instances = []
        overflow = overflow_shares(edge.spill_over.overflow, edge.by_model)
        for inst in edge.table.instances:
            health = edge.health.states.get(inst.id)
            load = edge.loads.get(inst.id)
            _, waiting, kv = load.snapshot()
            tokens[inst.id] = load.tokens
            sent = load.tokens - previous.get(inst.id, load.tokens)
            instances.append(
                {
                    "id": inst.id,
                    "healthy": health is not None and health.healthy,
                    "in_flight": load.inflight,
                    "queued": waiting + edge.lines.targeted.get(inst.id, 0),
                    "kv_cache_usage": min(1.0, max(0.0, kv)),
                    "tokens_per_s": round(max(0, sent) / elapsed, 3),
                    "overflow": overflow.get(inst.id, 0),
                }
            )
        self.tokens = tokens
        document: dict[str, Any] = {
            "applied_table_version": edge.table.version,
            "instances": instances,
            "budgets": edge.budgets.report(),
        }
        if edge.cfg.workers > 1:  # one worker of several (a single one stays readable by all)
            document["worker"] = edge.cfg.worker
            document["workers"] = edge.cfg.workers
        # Only to a control plane that lists cold models (an older one refuses the field),
        # and once more after the last one warmed, so that its demand is cleared.
        cold = edge.cold
        if cold.models or self.cold_reported:
            document["cold"] = cold.report()
        self.cold_reported = bool(cold.models)
        return document


def healthz_document(edge: Edge) -> dict[str, Any]:
    """Liveness plus what the scheduler currently believes about each instance."""
    now = time.monotonic()
    instances = {}
    for inst in edge.table.instances:
        health = edge.health.states.get(inst.id)
        load = edge.loads.get(inst.id)
        outstanding, waiting, kv = load.snapshot()
        instances[inst.id] = {
            "state": inst.state,
            "healthy": health is not None and health.healthy,
            "reason": health.reason if health is not None else "",
            "inflight": load.inflight,
            "peer_inflight": load.peer_inflight,
            "outstanding": outstanding,
            "waiting": waiting,
            "kv_cache_usage": kv,
            "scraped_age_s": round(now - load.scraped_at, 3) if load.engine else None,
        }
    healthy = sum(1 for v in instances.values() if v["healthy"])
    sync = edge.sync
    return {
        "status": "ok" if healthy else "degraded",
        "region": edge.cfg.region,
        "worker": edge.cfg.worker,
        "workers": edge.cfg.workers,
        "table_version": edge.table.version,
        "instances": len(edge.table.instances),
        "healthy_instances": healthy,
        "queue_depth": edge.lines.queued,
        "cold_models": {name: edge.cold.held(name) for name in sorted(edge.cold.models)},
        "table_source": "file" if sync is None else "control-plane",
        "sync_error": sync.last_error if sync is not None else "",
        "detail": instances,
    }
