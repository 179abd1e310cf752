"""The fleet's writes: one reconcile pass over the provisioned deployments, and one failover
pass over the regions. The worker's tasks call these; every decision is made by
``federation.fleet.policy`` (pure), every state change goes through the inventory services
(legal transitions, audited, a table recompile after commit).

Crash safety comes from the order of writes: an instance row is committed (pending) before its
engine is started, and marked failed or stopped before its engine is stopped. A worker killed
between the two halves leaves a row and an engine that the next pass matches up again by name
(the provisioner's own listing): a pending instance whose engine runs is adopted, not started
twice; an engine whose instance is terminal, or that no instance names, is stopped.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from federation.core.audit import audit_record
from federation.core.errors import Conflict
from federation.fleet import policy, selectors
from federation.fleet.locks import REGIONS_LOCK_ID, advisory_lock
from federation.fleet.models import InstanceRuntime, RegionFailover
from federation.fleet.probes import Probe, probe_engine
from federation.fleet.spec import Provisioner, ProvisionerError, Running
from federation.inventory import lifecycle
from federation.inventory import services as inventory
from federation.inventory.models import Deployment, Instance, Region

logger = logging.getLogger(__name__)

#: A deployment's lock id is its primary key; regions share id 0 (deployments start at 1).
_NAME_LIMIT = 63


@dataclass(frozen=True, slots=True)
class FleetConfig:
    timeouts: policy.Timeouts = field(default_factory=policy.Timeouts)
    health: policy.HealthPolicy = field(default_factory=policy.HealthPolicy)
    failover: policy.FailoverPolicy = field(default_factory=policy.FailoverPolicy)
    probe_timeout_s: float = 2.0
    #: Edge reports older than this say nothing about an instance's health or load.
    report_fresh_s: float = 10.0


def fleet_config() -> FleetConfig:
    """The fleet's timeouts and thresholds from the settings (``FEDINFER_FLEET_*``,
    ``FEDINFER_FAILOVER_*``; docs/operations.md)."""
    s = settings
    return FleetConfig(
        timeouts=policy.Timeouts(
            loading_s=s.FEDINFER_FLEET_LOADING_TIMEOUT_SECONDS,
            warming_s=s.FEDINFER_FLEET_WARMING_TIMEOUT_SECONDS,
            drain_s=s.FEDINFER_FLEET_DRAIN_TIMEOUT_SECONDS,
        ),
        health=policy.HealthPolicy(
            fail_after=s.FEDINFER_FLEET_FAIL_AFTER, recover_after=s.FEDINFER_FLEET_RECOVER_AFTER
        ),
        failover=policy.FailoverPolicy(
            edge_silence_s=s.FEDINFER_FAILOVER_EDGE_SILENCE_SECONDS,
            failed_share=s.FEDINFER_FAILOVER_FAILED_PERCENT / 100,
            min_failed=s.FEDINFER_FAILOVER_MIN_FAILED,
            failed_window_s=s.FEDINFER_FAILOVER_FAILED_WINDOW_SECONDS,
            restore_after_s=s.FEDINFER_FAILOVER_RESTORE_AFTER_SECONDS,
        ),
        probe_timeout_s=s.FEDINFER_FLEET_PROBE_TIMEOUT_SECONDS,
        report_fresh_s=s.FEDINFER_FLEET_REPORT_FRESH_SECONDS,
    )


# --- one reconcile pass ---------------------------------------------------------------------


def fleet_reconcile(
    *, provisioners: Mapping[str, Provisioner], config: FleetConfig | None = None
) -> list[str]:
    """One pass over every provisioned deployment (those another worker holds are skipped),
    then stop the engines no instance names. Returns what was done, one line per action.
    A provisioner that cannot list or act (its cluster away) costs its deployments this pass,
    not the others'."""
    config = config or fleet_config()
    done: list[str] = []
    for deployment in selectors.provisioned_deployments():
        kind = deployment.pool.provisioner
        if kind not in provisioners:
            logger.error("no %s provisioner configured for %s", kind, deployment)
            continue
        with advisory_lock(deployment.pk) as held:
            if not held:
                continue
            try:
                # Listed under the lock: another worker may have started engines until now.
                done += deployment_reconcile(
                    deployment=deployment,
                    provisioner=provisioners[kind],
                    listing=provisioners[kind].running(),
                    config=config,
                )
            except ProvisionerError as exc:
                logger.error("%s: %s", deployment, exc)
                done.append(f"{deployment}: {exc}")
    for kind, provisioner in provisioners.items():
        try:
            done += engines_orphaned_stop(provisioner=provisioner, listing=provisioner.running())
        except ProvisionerError as exc:
            logger.error("orphans of the %s provisioner: %s", kind, exc)
            done.append(f"{kind}: {exc}")
    return done


def engines_orphaned_stop(*, provisioner: Provisioner, listing: Mapping[str, Running]) -> list[str]:
    """Stop engines that no instance row names (rows are written before engines start, so
    such an engine was left by a deleted instance, never by a start in progress)."""
    known = set(Instance.objects.filter(name__in=list(listing)).values_list("name", flat=True))
    done = []
    for name in sorted(set(listing) - known):
        provisioner.stop(name)
        done.append(f"{name}: orphaned engine stopped")
    return done


def deployment_reconcile(
    *,
    deployment: Deployment,
    provisioner: Provisioner,
    listing: Mapping[str, Running],
    config: FleetConfig,
) -> list[str]:
    """Move each instance of ``deployment`` along its lifecycle, then match the replica count
    to ``desired_replicas``. The caller holds the deployment's lock."""
    done: list[str] = []
    now = timezone.now()
    # The worker acts on the instances it created (they have a runtime row, written with the
    # instance); one the operator registered by URL on this pool is the operator's.
    instances = [i for i in selectors.deployment_instances(deployment) if _managed(i)]
    # Probes are I/O only: all of the deployment's at once, so hung engines cost one timeout.
    with ThreadPoolExecutor(max_workers=max(1, min(16, len(instances)))) as pool:
        probes = list(
            pool.map(lambda i: _probe(deployment, i, i.name in listing, config), instances)
        )
    for instance, probe in zip(instances, probes, strict=True):
        obs = _observe(deployment, instance, instance.name in listing, probe, now, config)
        steps, count = policy.instance_steps(obs, timeouts=config.timeouts, health=config.health)
        if instance.state in lifecycle.LIVE_STATES:
            _store_health(instance, provisioner.kind, count, obs)
        for step in steps:
            done.append(_carry_out(step, instance, deployment, provisioner))
    done += _match_replicas(deployment, provisioner, config)
    return done


_PROBED = (lifecycle.LOADING, lifecycle.WARMING, lifecycle.READY, lifecycle.DRAINING)


def _probe(deployment: Deployment, instance: Instance, process: bool, config: FleetConfig) -> Probe:
    if instance.state not in _PROBED or not process:
        return Probe(False, False, "not probed")
    return probe_engine(
        instance.endpoint_url,
        deployment.model.name,
        timeout_s=config.probe_timeout_s,
        with_load=instance.state == lifecycle.DRAINING,
    )


def _observe(
    deployment: Deployment,
    instance: Instance,
    process: bool,
    probe: Probe,
    now: datetime,
    config: FleetConfig,
) -> policy.Observed:
    draining = instance.state == lifecycle.DRAINING
    unhealthy, _ = selectors.edge_view(instance, now, config.report_fresh_s)
    runtime = getattr(instance, "runtime", None)
    since = instance.state_changed_at or instance.created_at
    return policy.Observed(
        name=instance.name,
        state=instance.state,
        drain_reason=instance.drain_reason,
        state_age_s=(now - since).total_seconds(),
        process=process,
        answers=probe.answers,
        serves_model=probe.serves_model,
        edges_unhealthy=unhealthy,
        in_flight=probe.in_flight,
        edges_caught_up=draining
        and selectors.edges_caught_up(instance, now, config.report_fresh_s),
        health=policy.HealthCount(runtime.failures, runtime.successes)
        if runtime is not None
        else policy.HealthCount(),
        region_active=deployment.pool.region.status == Region.Status.ACTIVE,
    )


def _store_health(
    instance: Instance, kind: str, count: policy.HealthCount, obs: policy.Observed
) -> None:
    """The probe counts, written only when they change (not once per instance per pass)."""
    problem = ""
    if obs.state in (lifecycle.READY, lifecycle.DRAINING) and count.failures:
        problem = "edges report it unhealthy" if obs.edges_unhealthy else "probe failed"
    runtime: InstanceRuntime | None = getattr(instance, "runtime", None)
    if runtime is not None and (runtime.failures, runtime.successes, runtime.last_problem) == (
        count.failures,
        count.successes,
        problem,
    ):
        return
    InstanceRuntime.objects.update_or_create(
        instance=instance,
        defaults={
            "provisioner": kind,
            "failures": count.failures,
            "successes": count.successes,
            "last_problem": problem,
        },
    )


def _carry_out(
    step: policy.Step, instance: Instance, deployment: Deployment, provisioner: Provisioner
) -> str:
    """One step; a refused transition (the state moved meanwhile) is reported, not raised."""
    try:
        if step.act == policy.Act.START:
            spec = selectors.engine_spec(deployment, name=instance.name, url=instance.endpoint_url)
            provisioner.start(spec)
            _audit_engine(instance, "fleet.engine_start", provisioner.kind)
            inventory.instance_transition(actor=None, instance=instance, state=lifecycle.LOADING)
        elif step.act == policy.Act.MOVE:
            inventory.instance_transition(
                actor=None, instance=instance, state=step.target, note=step.reason
            )
        elif step.act == policy.Act.FAIL:
            inventory.instance_transition(
                actor=None, instance=instance, state=lifecycle.FAILED, note=step.reason
            )
            _stop_engine(instance, provisioner)
        elif step.act == policy.Act.STOP:
            if instance.state not in lifecycle.TERMINAL_STATES:
                inventory.instance_transition(
                    actor=None, instance=instance, state=lifecycle.STOPPED, note=step.reason
                )
            _stop_engine(instance, provisioner)
    except Conflict as exc:
        return f"{instance.name}: {step.act} refused: {exc}"
    except ProvisionerError as exc:
        if step.act == policy.Act.START:  # it cannot run as specified: fail it, say why
            inventory.instance_transition(
                actor=None, instance=instance, state=lifecycle.FAILED, note=str(exc)[:300]
            )
        # A stop that failed is tried again next pass (a terminal instance's engine runs).
        return f"{instance.name}: {step.act} failed: {exc}"
    return f"{instance.name}: {step.act} {step.target} {step.reason}".rstrip()


def _stop_engine(instance: Instance, provisioner: Provisioner) -> None:
    provisioner.stop(instance.name)
    _audit_engine(instance, "fleet.engine_stop", provisioner.kind)


@transaction.atomic
def _audit_engine(instance: Instance, action: str, kind: str) -> None:
    audit_record(actor=None, action=action, obj=instance, changes={"provisioner": kind})


def _managed(instance: Instance) -> bool:
    return getattr(instance, "runtime", None) is not None


def _replicas(deployment: Deployment, config: FleetConfig) -> list[policy.Replica]:
    now = timezone.now()
    return [
        policy.Replica(
            name=inst.name,
            state=inst.state,
            drain_reason=inst.drain_reason,
            in_flight=selectors.edge_view(inst, now, config.report_fresh_s)[1] or 0,
            created_order=order,
            managed=_managed(inst),
        )
        for order, inst in enumerate(selectors.deployment_instances(deployment))
    ]


def _match_replicas(
    deployment: Deployment, provisioner: Provisioner, config: FleetConfig
) -> list[str]:
    deployment.refresh_from_db(fields=["desired_replicas", "max_replicas"])
    pool, region = deployment.pool, deployment.pool.region
    pool.refresh_from_db(fields=["status"])
    region.refresh_from_db(fields=["status"])
    plan = policy.replica_plan(
        _replicas(deployment, config),
        desired=deployment.desired_replicas,
        max_replicas=deployment.max_replicas,
        can_place=pool.status == pool.Status.ACTIVE and region.status == Region.Status.ACTIVE,
    )
    by_name = {i.name: i for i in selectors.deployment_instances(deployment)}
    done = []
    for name in plan.undrain:
        inventory.instance_undrain(actor=None, instance=by_name[name])
        done.append(f"{name}: undrained (scale up)")
    for _ in range(plan.create):
        instance = _create_replica(deployment, provisioner)
        step = policy.Step(instance.name, policy.Act.START, lifecycle.LOADING)
        done.append(_carry_out(step, instance, deployment, provisioner))
    for name in plan.stop:
        step = policy.Step(name, policy.Act.STOP, lifecycle.STOPPED, "scale down")
        done.append(_carry_out(step, by_name[name], deployment, provisioner))
    for name in plan.drain:
        inventory.instance_drain(
            actor=None, instance=by_name[name], reason=Instance.DrainReason.SCALE_DOWN
        )
        done.append(f"{name}: draining (scale down)")
    return done


def _instance_name(deployment: Deployment) -> str:
    suffix = f"-{deployment.pk}-{secrets.token_hex(3)}"
    prefix = f"{deployment.pool.region.code}-{deployment.pool.name}"
    return prefix[: _NAME_LIMIT - len(suffix)].rstrip("-") + suffix


@transaction.atomic
def _create_replica(deployment: Deployment, provisioner: Provisioner) -> Instance:
    """The row first, committed before the engine starts (see the module's docstring)."""
    name = _instance_name(deployment)
    instance = inventory.instance_create(
        actor=None,
        deployment=deployment,
        name=name,
        endpoint_url=provisioner.endpoint_for(name),
    )
    InstanceRuntime.objects.create(instance=instance, provisioner=provisioner.kind)
    return instance


# --- one failover pass over the regions --------------------------------------------------------


def fleet_failover(*, config: FleetConfig | None = None) -> list[str]:
    """Evacuate the regions in trouble, restore those the fleet evacuated once stable."""
    config = config or fleet_config()
    done: list[str] = []
    with advisory_lock(REGIONS_LOCK_ID) as held:
        if not held:
            return done
        for region in Region.objects.select_related("failover").order_by("code"):
            line = region_failover_step(region=region, config=config)
            if line:
                done.append(line)
    return done


def region_failover_step(*, region: Region, config: FleetConfig) -> str:
    """Observe one region, decide (``policy.region_verdict``) and act; what was done."""
    now = timezone.now()
    mark: RegionFailover | None = getattr(region, "failover", None)
    auto = mark is not None and mark.evacuated_at is not None
    failed, serving = selectors.region_instance_counts(region, now, config.failover.failed_window_s)
    stable_since = mark.stable_since if auto and mark is not None else None
    obs = policy.RegionObserved(
        code=region.code,
        status=region.status,
        edge_silence_s=selectors.region_edge_silence(region, now),
        recently_failed=failed,
        serving=serving,
        auto_evacuated=auto,
        stable_for_s=None if stable_since is None else (now - stable_since).total_seconds(),
    )
    verdict, why = policy.region_verdict(obs, config.failover)
    if verdict == policy.Verdict.EVACUATE:
        _region_evacuate(region, why, now)
        return f"{region.code}: evacuated ({why})"
    if verdict == policy.Verdict.RESTORE:
        _region_restore(region, why)
        return f"{region.code}: restored ({why})"
    if verdict == policy.Verdict.FORGET:
        RegionFailover.objects.filter(region=region).update(evacuated_at=None, stable_since=None)
        return f"{region.code}: restored by an operator; the fleet's evacuation mark dropped"
    if verdict == policy.Verdict.STABLE and stable_since is None:
        RegionFailover.objects.filter(region=region).update(stable_since=now)
        return f"{region.code}: stable, restored after {config.failover.restore_after_s:g} s"
    if verdict == policy.Verdict.UNSTABLE and stable_since is not None:
        RegionFailover.objects.filter(region=region).update(stable_since=None)
        return f"{region.code}: unstable again ({why})"
    return ""


@transaction.atomic
def _region_evacuate(region: Region, why: str, now: datetime) -> None:
    inventory.region_evacuate(actor=None, region=region)
    RegionFailover.objects.update_or_create(
        region=region, defaults={"evacuated_at": now, "reason": why, "stable_since": None}
    )
    audit_record(actor=None, action="fleet.region_evacuate", obj=region, changes={"reason": why})


@transaction.atomic
def _region_restore(region: Region, why: str) -> None:
    inventory.region_restore(actor=None, region=region)
    RegionFailover.objects.filter(region=region).update(evacuated_at=None, stable_since=None)
    audit_record(actor=None, action="fleet.region_restore", obj=region, changes={"reason": why})
