"""The demo fleet's rows for a run of ``fedinfer demo``: what an earlier run left is cleared
(engines, instances, edges, evacuations and cordons), the tenants' demo keys are rotated, the
deployments are set up for the worker (local provisioner, replica counts, the autoscaled
Llama-8B ones) and the fleet is read back (its deployments, whether they are ready, the ready
engines).

A module of its own so that the ``demo`` command stays its entry point (options, start-up
order, supervision loop); ``registerdemo`` names instances and edges the same way
(``DEMO_PREFIX``, ``demo_instance_name``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from federation.demo import fleet
from federation.inventory import lifecycle
from federation.inventory import services as inventory
from federation.inventory.models import Deployment, Edge, GPUPool, Instance, Region
from federation.tenancy import services as tenancy
from federation.tenancy.models import ApiKey
from workers.provisioners.local import LocalProvisioner

DEMO_PREFIX = "demo-"
#: The demo's autoscaled deployments: the mixed ones of the model every tenant's traffic asks
#: for, between these bounds, each replica running AUTOSCALED_SEQS requests at once (a small
#: replica, so that a few requests per second fill one at a region's peak).
AUTOSCALED_MODEL = "meta-llama/Llama-3.1-8B-Instruct"
AUTOSCALED_MIN, AUTOSCALED_MAX = 1, 3
AUTOSCALED_SEQS = 2


def _slug(text: str) -> str:
    out = "".join(c if c.isalnum() else "-" for c in text.lower())
    return "-".join(part for part in out.split("-") if part)


def demo_instance_name(dep: Deployment, index: int) -> str:
    """The name of a deployment's ``index``-th engine in the demo (also ``registerdemo``)."""
    return (
        f"{DEMO_PREFIX}{dep.pool.region.code}-{dep.pool.name}-"
        f"{_slug(dep.model.name.split('/')[-1])}-{dep.role}-{index}"
    )[:63].rstrip("-")


def demo_deployments() -> list[Deployment]:
    """The deployments of the demo fleet (``federation.demo.fleet``), with pool and model."""
    keys = {(region, pool, model, role) for region, pool, model, role, *_ in fleet.DEPLOYMENTS}
    found = Deployment.objects.select_related("pool__region", "model").order_by("pk")
    return [
        dep
        for dep in found
        if (dep.pool.region.code, dep.pool.name, dep.model.name, dep.role) in keys
    ]


def ready_instances() -> list[tuple[str, str]]:
    """(name, URL) of the demo's ready instances."""
    ready = Instance.objects.filter(
        deployment__in=demo_deployments(), state=Instance.State.READY
    ).order_by("name")
    return list(ready.values_list("name", "endpoint_url"))


def forget_previous_run(engines: LocalProvisioner) -> None:
    """Stop the engines and remove the instances and edges of a demo run (ports change per
    run): the worker is not running, so nothing replaces them."""
    for name in engines.running():
        engines.stop(name)
    for inst in Instance.objects.filter(deployment__in=demo_deployments()):
        if inst.state not in lifecycle.TERMINAL_STATES:
            inst = inventory.instance_transition(actor=None, instance=inst, state="stopped")
        inventory.instance_delete(actor=None, instance=inst)
    for edge in Edge.objects.filter(name__startswith=DEMO_PREFIX):
        inventory.edge_delete(actor=None, edge=edge)


def back_in_service(out: Callable[[str], None]) -> None:
    """Every run starts with the whole fleet in service: an evacuation or cordon left by an
    earlier run would refuse the instances this run registers."""
    for region in Region.objects.exclude(status=Region.Status.ACTIVE).order_by("code"):
        inventory.region_restore(actor=None, region=region)
        out(f"demo: region {region.code} was {region.status}; restored")
    for pool in GPUPool.objects.exclude(status=GPUPool.Status.ACTIVE).select_related("region"):
        inventory.pool_uncordon(actor=None, pool=pool)
        out(f"demo: pool {pool.region.code}/{pool.name} was cordoned; uncordoned")


def fresh_keys() -> dict[str, str]:
    """Rotate each tenant's 'demo' key, so this run can show (and test with) its plaintext;
    the tables compiled next carry the new hashes."""
    keys = {}
    for api_key in ApiKey.objects.filter(name="demo", revoked_at__isnull=True).select_related(
        "tenant"
    ):
        keys[api_key.tenant.slug] = tenancy.api_key_rotate(actor=None, api_key=api_key).plaintext
    return keys


def configure_fleet(engines_per_deployment: int) -> None:
    """Hand the demo's pools to the worker's local provisioner and set each deployment's
    replicas: the mixed Llama-8B ones autoscaled within AUTOSCALED_MIN..MAX, the others
    fixed at ``engines_per_deployment`` (``--engines-per-deployment``)."""
    wanted = max(1, engines_per_deployment)
    for dep in demo_deployments():
        if dep.pool.provisioner != GPUPool.Provisioner.LOCAL:
            inventory.pool_update(
                actor=None, pool=dep.pool, data={"provisioner": GPUPool.Provisioner.LOCAL}
            )
        if dep.model.name == AUTOSCALED_MODEL and dep.role == Deployment.Role.MIXED:
            data: dict[str, Any] = {
                "autoscale": True,
                "min_replicas": AUTOSCALED_MIN,
                "max_replicas": AUTOSCALED_MAX,
                "desired_replicas": min(max(wanted, AUTOSCALED_MIN), AUTOSCALED_MAX),
                "engine_args": {**dep.engine_args, "max-num-seqs": AUTOSCALED_SEQS},
            }
        else:
            data = {
                "autoscale": False,
                "scale_to_zero_after_s": None,
                "min_replicas": min(dep.min_replicas, wanted),
                "max_replicas": max(dep.max_replicas, wanted),
                "desired_replicas": wanted,
            }
        inventory.deployment_update(actor=None, deployment=dep, data=data)


def fleet_ready() -> bool:
    """Every deployment has its desired replicas ready (the worker brought them up)."""
    for dep in demo_deployments():
        ready = dep.instances.filter(state=Instance.State.READY).count()
        if ready < dep.desired_replicas:
            return False
    return True
