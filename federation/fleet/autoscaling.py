"""The autoscaler's writes: one pass over the autoscaled deployments. Each is observed (its
instances' states, the load its edges report, its pool's free GPUs), handed to the pure
``federation.fleet.autoscaler`` policy, and its ``desired_replicas`` set through the inventory
service when the policy says so (audited); the reconcile pass then starts or drains replicas.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime

from django.conf import settings
from django.core.exceptions import ValidationError
from django.db import transaction
from django.utils import timezone

from federation.core.audit import audit_record
from federation.core.errors import Conflict
from federation.fleet import adapters, autoscaler, forecast, forecasting, selectors
from federation.fleet.locks import advisory_lock
from federation.fleet.models import DeploymentAutoscale
from federation.inventory import lifecycle
from federation.inventory import services as inventory
from federation.inventory.models import Deployment
from federation.inventory.speed import replica_tokens_per_s
from federation.routing.selectors import VLLM_DEFAULT_MAX_NUM_SEQS

logger = logging.getLogger(__name__)

_COMING = (lifecycle.PENDING, lifecycle.LOADING, lifecycle.WARMING)


@dataclass(frozen=True, slots=True)
class AutoscaleConfig:
    policy: autoscaler.AutoscalePolicy = field(default_factory=autoscaler.AutoscalePolicy)
    #: Edge reports older than this say nothing about a replica's load.
    report_fresh_s: float = 10.0
    #: Warm preloading: the forecast (plus warm spare) is a floor under ``desired_replicas``.
    preload: forecast.ForecastPolicy = field(default_factory=forecast.ForecastPolicy)


def autoscale_config() -> AutoscaleConfig:
    """The band, window and cooldown from the settings (``FEDINFER_AUTOSCALE_*``)."""
    s = settings
    return AutoscaleConfig(
        policy=autoscaler.AutoscalePolicy(
            target=s.FEDINFER_AUTOSCALE_TARGET_PERCENT / 100,
            low=s.FEDINFER_AUTOSCALE_LOW_PERCENT / 100,
            high=s.FEDINFER_AUTOSCALE_HIGH_PERCENT / 100,
            down_window_s=s.FEDINFER_AUTOSCALE_DOWN_WINDOW_SECONDS,
            cooldown_s=s.FEDINFER_AUTOSCALE_COOLDOWN_SECONDS,
            smoothing_s=s.FEDINFER_AUTOSCALE_SMOOTHING_SECONDS,
        ),
        report_fresh_s=s.FEDINFER_FLEET_REPORT_FRESH_SECONDS,
    )


def fleet_autoscale(*, config: AutoscaleConfig | None = None) -> list[str]:
    """One pass over the autoscaled deployments (one another worker holds is skipped: the
    lock is the reconcile pass's, so a count never changes in the middle of one), then the
    LoRA adapters the edges report demand for loaded where it appears (``adapters.py``).
    Returns the changes made, one line each."""
    config = config or autoscale_config()
    done: list[str] = []
    deployments = list(selectors.autoscaled_deployments())
    floors = forecasting.forecast_floors(
        deployments, now=timezone.now(), policy=config.preload, target=config.policy.target
    )
    for deployment in deployments:
        with advisory_lock(deployment.pk) as held:
            if not held:
                continue
            line = deployment_autoscale(
                deployment=deployment,
                config=config,
                now=timezone.now(),
                floor=floors.get(deployment.pk),
            )
            if line:
                done.append(line)
    done += adapters.fleet_adapters_load(
        now=timezone.now(),
        fresh_s=config.report_fresh_s,
        timeout_s=float(settings.FEDINFER_ADAPTER_LOAD_SECONDS),
    )
    return done


def deployment_autoscale(
    *,
    deployment: Deployment,
    config: AutoscaleConfig,
    now: datetime,
    floor: forecasting.Floor | None = None,
) -> str:
    """Observe, decide, and set ``desired_replicas`` when it changes; what was done ('' when
    nothing). The caller holds the deployment's lock. ``floor``: the forecast's replicas, a
    raised minimum for the policy (within ``max_replicas`` and the pool's free GPUs)."""
    deployment.refresh_from_db(
        fields=["desired_replicas", "min_replicas", "max_replicas", "scale_to_zero_after_s"]
    )
    obs = _observe(deployment, now, config.report_fresh_s)
    forecast_min = 0
    if floor is not None:
        room = obs.desired + max(0, obs.free_gpus) // max(1, obs.gpus_per_replica)
        forecast_min = min(floor.replicas, obs.max_replicas, max(obs.desired, room))
        if forecast_min > obs.min_replicas:
            obs = replace(obs, min_replicas=forecast_min)
    state = DeploymentAutoscale.objects.filter(deployment=deployment).first()
    memory = autoscaler.Memory(
        low_since=_seconds(state.low_since) if state else None,
        changed_at=_seconds(state.changed_at) if state else None,
        load=state.load if state else None,
        observed_at=_seconds(state.observed_at) if state else None,
        idle_since=_seconds(state.idle_since) if state else None,
    )
    decision = autoscaler.autoscale_step(obs, memory, now=now.timestamp(), policy=config.policy)
    if floor is not None and decision.desired == forecast_min > deployment.desired_replicas:
        why = (
            f"forecast floor: {forecast_min} replicas for {floor.tokens_per_s:.0f} tokens/s "
            f"expected within {config.preload.lead_time_s:.0f} s "
            f"({floor.spare_tokens_per_s:.0f} of them warm spare)"
        )
        decision = replace(decision, reason=why)
    before = deployment.desired_replicas
    line = ""
    if decision.changed(before):
        try:
            changed_at = _scale(deployment, decision)
        except (ValidationError, Conflict) as exc:
            logger.warning("%s: autoscale to %s refused: %s", deployment, decision.desired, exc)
            return f"{deployment}: scale {before} -> {decision.desired} refused: {exc}"
        # The cooldown runs from the recorded change, not from the start of this pass: the
        # audit trail then never shows two changes closer than the cooldown.
        memory = replace(decision.memory, changed_at=changed_at.timestamp())
        decision = replace(decision, memory=memory)
        line = f"{deployment}: {before} -> {decision.desired} replicas ({decision.reason})"
    _remember(deployment, state, decision)
    return line


def _observe(deployment: Deployment, now: datetime, fresh_s: float) -> autoscaler.DeploymentLoad:
    pool, model = deployment.pool, deployment.model
    max_seqs = deployment.engine_args.get("max-num-seqs", VLLM_DEFAULT_MAX_NUM_SEQS)
    full = replica_tokens_per_s(
        relative_speed=pool.accelerator.relative_speed,
        tensor_parallel_size=deployment.tensor_parallel_size,
        params_b=float(model.parameter_count_b),
    )
    instances = selectors.deployment_instances(deployment)
    ready: list[autoscaler.ReplicaLoad] = []
    unreported = 0
    for inst in instances:
        if inst.state != lifecycle.READY:
            continue
        seen = selectors.instance_load(inst, now, fresh_s)
        if seen is None:
            unreported += 1
            continue
        in_flight, queued, kv, tokens, overflow = seen
        ready.append(
            autoscaler.ReplicaLoad(
                in_flight=in_flight,
                queued=queued,
                kv_cache_usage=kv,
                tokens_per_s=tokens,
                max_concurrency=int(max_seqs),
                full_tokens_per_s=full,
                overflow=overflow,
            )
        )
    return autoscaler.DeploymentLoad(
        desired=deployment.desired_replicas,
        min_replicas=deployment.min_replicas,
        max_replicas=deployment.max_replicas,
        coming=sum(1 for i in instances if i.state in _COMING),
        ready=ready,
        unreported=unreported,
        free_gpus=selectors.pool_free_gpus(pool),
        gpus_per_replica=deployment.tensor_parallel_size,
        scale_to_zero_after_s=(
            None
            if deployment.scale_to_zero_after_s is None
            else float(deployment.scale_to_zero_after_s)
        ),
        held=(
            selectors.cold_demand(deployment, now, fresh_s)
            if deployment.desired_replicas == 0
            else 0
        ),
    )


@transaction.atomic
def _scale(deployment: Deployment, decision: autoscaler.Decision) -> datetime:
    """Set the count and audit it; when the change was recorded."""
    before = deployment.desired_replicas
    inventory.deployment_update(
        actor=None, deployment=deployment, data={"desired_replicas": decision.desired}
    )
    event = audit_record(
        actor=None,
        action="fleet.autoscale",
        obj=deployment,
        changes={
            "desired_replicas": [before, decision.desired],
            "reason": decision.reason,
            "utilisation": None if decision.utilisation is None else round(decision.utilisation, 3),
        },
    )
    return event.created_at


def _remember(
    deployment: Deployment, state: DeploymentAutoscale | None, decision: autoscaler.Decision
) -> None:
    """The policy's memory and what it saw (one row per deployment, written each pass while
    its load is reported: the smoothed load moves with every report)."""
    memory = decision.memory
    fields = {
        "low_since": _datetime(memory.low_since),
        "changed_at": _datetime(memory.changed_at),
        "load": memory.load,
        "observed_at": _datetime(memory.observed_at),
        "idle_since": _datetime(memory.idle_since),
        "utilisation": decision.utilisation,
        "reason": decision.reason[:200],
    }
    if state is not None and all(getattr(state, k) == v for k, v in fields.items()):
        return
    DeploymentAutoscale.objects.update_or_create(deployment=deployment, defaults=fields)


def _seconds(at: datetime | None) -> float | None:
    return None if at is None else at.timestamp()


def _datetime(seconds: float | None) -> datetime | None:
    return None if seconds is None else datetime.fromtimestamp(seconds, tz=UTC)
