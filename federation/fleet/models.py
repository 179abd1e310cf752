"""What the fleet remembers between two passes of the worker: per instance its probe counts
(hysteresis), per region whether the fleet itself evacuated it and since when it is stable, per
autoscaled deployment since when its load is low and when it was last scaled."""

from __future__ import annotations

from django.db import models

from federation.inventory.models import Deployment, Instance, Region


class InstanceRuntime(models.Model):
    """The worker's view of one provisioned instance (static instances have none)."""

    instance = models.OneToOneField(
        Instance, on_delete=models.CASCADE, primary_key=True, related_name="runtime"
    )
    provisioner = models.CharField(max_length=16)
    failures = models.PositiveIntegerField(
        default=0, help_text="Failed probes not yet cleared by enough consecutive successes."
    )
    successes = models.PositiveIntegerField(
        default=0, help_text="Consecutive good probes since the last failure."
    )
    last_problem = models.CharField(max_length=300, blank=True, default="")

    def __str__(self) -> str:
        return f"runtime of {self.instance_id}"


class RegionFailover(models.Model):
    """Set while the fleet's own evacuation of a region stands; an operator's restore clears it."""

    region = models.OneToOneField(
        Region, on_delete=models.CASCADE, primary_key=True, related_name="failover"
    )
    evacuated_at = models.DateTimeField(null=True, blank=True)
    reason = models.CharField(max_length=300, blank=True, default="")
    stable_since = models.DateTimeField(
        null=True, blank=True, help_text="Since when the trouble that evacuated it is gone."
    )

    def __str__(self) -> str:
        return f"failover of {self.region_id}"


class DeploymentAutoscale(models.Model):
    """The autoscaler's memory of one deployment (``federation.fleet.autoscaler.Memory``) and
    what it last saw, for operators."""

    deployment = models.OneToOneField(
        Deployment, on_delete=models.CASCADE, primary_key=True, related_name="autoscale_state"
    )
    low_since = models.DateTimeField(
        null=True,
        blank=True,
        help_text="Since when one replica is spare (its load below the band).",
    )
    changed_at = models.DateTimeField(
        null=True, blank=True, help_text="When the autoscaler last changed its replica count."
    )
    load = models.FloatField(
        null=True, blank=True, help_text="Smoothed sum of its ready replicas' utilisations."
    )
    observed_at = models.DateTimeField(null=True, blank=True)
    idle_since = models.DateTimeField(
        null=True,
        blank=True,
        help_text="Since when nothing was asked of it (scale to zero's clock).",
    )
    utilisation = models.FloatField(null=True, blank=True, help_text="Smoothed mean utilisation.")
    reason = models.CharField(max_length=200, blank=True, default="")

    def __str__(self) -> str:
        return f"autoscale of {self.deployment_id}"


class PlacementPlan(models.Model):
    """A plan of the placement planner (``federation.fleet.placement``): the diff it proposes
    and the fleet it was computed against, kept so that it can be applied by id, once, and
    only to that fleet."""

    created_at = models.DateTimeField(auto_now_add=True)
    created_by = models.CharField(max_length=150, blank=True, default="")
    #: SHA-256 of the deployments and pools the plan was computed from.
    fleet_fingerprint = models.CharField(max_length=64)
    #: The plan as the API returns it (placements, unserved demand, costs, solver status).
    document = models.JSONField()
    applied_at = models.DateTimeField(null=True, blank=True)
    applied_by = models.CharField(max_length=150, blank=True, default="")

    class Meta:
        ordering = ["-created_at", "-pk"]

    def __str__(self) -> str:
        return f"placement plan {self.pk}"
