"""The fleet: regions, GPU pools, models, adapters, deployments, instances and edges.

Models hold fields and database constraints only. Rules that need more than one row (does a
deployment fit its pool?) live in ``fit.py`` (pure) and are enforced by ``services.py``.
"""

from __future__ import annotations

import re
from decimal import Decimal

from django.core.validators import (
    MaxValueValidator,
    MinValueValidator,
    RegexValidator,
    URLValidator,
)
from django.db import models
from django.utils.regex_helper import _lazy_re_compile

from federation.core.models import TimeStampedModel
from regions.tables.schema import MAX_EDGE_WORKERS

#: Worker processes an edge may run unless an operator allows more: each one is a holder of
#: budget leases and a share of every rate limit, so the bound is what a heartbeat can claim.
DEFAULT_EDGE_MAX_WORKERS = 8


class ServiceURLValidator(URLValidator):
    """An http(s) origin, ``scheme://host[:port]`` (a trailing ``/`` allowed), whose host may
    also be a single DNS label: inside a cluster an engine is often ``http://vllm-0:8000``
    (Django's URLValidator wants a dot or 'localhost'). No user info, path, query or fragment:
    the edges refuse a routing table naming such a URL as a whole (regions/tables/schema.py), so
    one bad registration would stop a region's table updates."""

    schemes = ["http", "https"]
    host_re = (
        "("
        + URLValidator.hostname_re
        + URLValidator.domain_re
        + URLValidator.tld_re
        + "|"
        + URLValidator.hostname_re
        + ")"
    )
    regex = _lazy_re_compile(
        r"^(?:[a-z0-9.+-]*)://"
        r"(?:" + URLValidator.ipv4_re + "|" + URLValidator.ipv6_re + "|" + host_re + ")"
        r"(?::[0-9]{1,5})?"
        r"/?"
        r"\Z",
        re.IGNORECASE,
    )


service_url_validator = ServiceURLValidator()

slug_validator = RegexValidator(
    r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$",
    "Use 1-63 lowercase letters, digits and inner hyphens (like 'us-east-1').",
)


class Jurisdiction(models.TextChoices):
    US = "US", "United States"
    EU = "EU", "European Union"
    UK = "UK", "United Kingdom"
    CH = "CH", "Switzerland"
    CN = "CN", "China"
    APAC = "APAC", "Asia-Pacific"
    IN = "IN", "India"
    CA = "CA", "Canada"
    LATAM = "LATAM", "Latin America"
    MEA = "MEA", "Middle East and Africa"


class Region(TimeStampedModel):
    class Provider(models.TextChoices):
        CLOUD = "cloud", "Cloud"
        NEOCLOUD = "neocloud", "Neocloud"
        ON_PREM = "on_prem", "On-premises"

    class Status(models.TextChoices):
        ACTIVE = "active", "Active"
        CORDONED = "cordoned", "Cordoned (no new placements)"
        EVACUATED = "evacuated", "Evacuated (no traffic)"

    code = models.CharField(max_length=63, unique=True, validators=[slug_validator])
    name = models.CharField(max_length=100)
    provider = models.CharField(max_length=16, choices=Provider.choices)
    latitude = models.FloatField(validators=[MinValueValidator(-90), MaxValueValidator(90)])
    longitude = models.FloatField(validators=[MinValueValidator(-180), MaxValueValidator(180)])
    jurisdiction = models.CharField(max_length=8, choices=Jurisdiction.choices)
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.ACTIVE)
    #: Its traffic comes back gradually from the later of these (the routing compiler's ramp).
    restored_at = models.DateTimeField(
        null=True, blank=True, help_text="When it was last restored from an evacuation."
    )
    recovered_at = models.DateTimeField(
        null=True,
        blank=True,
        help_text="When its edges last reported an instance healthy again after all were lost.",
    )

    class Meta:
        ordering = ["code"]

    def __str__(self) -> str:
        return self.code


class RegionLink(TimeStampedModel):
    """One directed entry of the inter-region RTT matrix."""

    source = models.ForeignKey(Region, on_delete=models.CASCADE, related_name="links_out")
    target = models.ForeignKey(Region, on_delete=models.CASCADE, related_name="links_in")
    rtt_ms = models.FloatField(
        validators=[MinValueValidator(0), MaxValueValidator(10_000)],
        help_text="Configured round-trip time in milliseconds.",
    )
    measured_rtt_ms = models.FloatField(
        null=True,
        blank=True,
        validators=[MinValueValidator(0)],
        help_text="Latest measured round-trip time (edges report it); preferred when present.",
    )

    class Meta:
        ordering = ["source__code", "target__code"]
        constraints = [
            models.UniqueConstraint(fields=["source", "target"], name="regionlink_unique_pair"),
            models.CheckConstraint(
                condition=~models.Q(source=models.F("target")), name="regionlink_not_self"
            ),
        ]

    def __str__(self) -> str:
        return f"{self.source.code}->{self.target.code}"


class AcceleratorType(models.Model):
    """Catalog row: what one GPU of this type offers. Seeded by a data migration."""

    name = models.CharField(max_length=32, unique=True)
    vendor = models.CharField(max_length=32)
    memory_gib = models.PositiveIntegerField(validators=[MinValueValidator(1)])
    relative_speed = models.FloatField(
        validators=[MinValueValidator(0.01)],
        help_text="Throughput relative to one H100-80G (1.0) for dense bf16 inference.",
    )
    memory_bandwidth_gbps = models.PositiveIntegerField(help_text="HBM/GDDR bandwidth, GB/s.")
    supports_nvlink = models.BooleanField(default=False)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name


class GPUPool(TimeStampedModel):
    class Interconnect(models.TextChoices):
        NVLINK = "nvlink", "NVLink"
        PCIE = "pcie", "PCIe"

    class CapacityType(models.TextChoices):
        ON_DEMAND = "on_demand", "On-demand"
        RESERVED = "reserved", "Reserved"
        SPOT = "spot", "Spot"

    class Status(models.TextChoices):
        ACTIVE = "active", "Active"
        CORDONED = "cordoned", "Cordoned (no new replicas)"

    class Provisioner(models.TextChoices):
        STATIC = "static", "Static (engines run by the operator, registered by URL)"
        LOCAL = "local", "Local processes (engine simulator or vLLM)"
        KUBERNETES = "kubernetes", "Kubernetes workloads"

    region = models.ForeignKey(Region, on_delete=models.PROTECT, related_name="pools")
    name = models.CharField(max_length=63, validators=[slug_validator])
    accelerator = models.ForeignKey(AcceleratorType, on_delete=models.PROTECT, related_name="pools")
    gpus_per_node = models.PositiveSmallIntegerField(
        validators=[MinValueValidator(1), MaxValueValidator(16)]
    )
    node_count = models.PositiveIntegerField(validators=[MaxValueValidator(100_000)])
    interconnect = models.CharField(
        max_length=8, choices=Interconnect.choices, help_text="Between the GPUs of one node."
    )
    rdma = models.BooleanField(
        default=False, help_text="Nodes are linked by RDMA (InfiniBand/RoCE): multi-node TP works."
    )
    price_per_gpu_hour = models.DecimalField(
        max_digits=10, decimal_places=4, validators=[MinValueValidator(0)]
    )
    capacity_type = models.CharField(max_length=16, choices=CapacityType.choices)
    gpu_memory_utilization = models.FloatField(
        default=0.9,
        validators=[MinValueValidator(0.1), MaxValueValidator(0.98)],
        help_text="Share of GPU memory vLLM may use (its --gpu-memory-utilization).",
    )
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.ACTIVE)
    provisioner = models.CharField(
        max_length=16,
        choices=Provisioner.choices,
        default=Provisioner.STATIC,
        help_text="Who starts its engines: the operator (static), or the worker (local, "
        "kubernetes), which then keeps each deployment at its desired_replicas.",
    )

    class Meta:
        ordering = ["region__code", "name"]
        constraints = [
            models.UniqueConstraint(
                fields=["region", "name"], name="gpupool_unique_name_in_region"
            ),
        ]

    def __str__(self) -> str:
        return f"{self.region.code}/{self.name}"

    @property
    def total_gpus(self) -> int:
        return self.gpus_per_node * self.node_count


class LanguageModel(TimeStampedModel):
    """A base model that can be served (the API calls these 'models')."""

    class DType(models.TextChoices):
        BF16 = "bf16", "bfloat16"
        FP16 = "fp16", "float16"
        FP8 = "fp8", "FP8"
        INT8 = "int8", "INT8 (W8A8)"
        INT4 = "int4", "INT4 (AWQ/GPTQ)"

    name = models.CharField(
        max_length=128,
        unique=True,
        validators=[
            RegexValidator(
                r"^[A-Za-z0-9][A-Za-z0-9._/-]*$",
                "Use letters, digits and . _ / - (like 'meta-llama/Llama-3.1-8B').",
            )
        ],
        help_text="The name clients send as 'model'.",
    )
    family = models.CharField(max_length=64)
    parameter_count_b = models.DecimalField(
        max_digits=8,
        decimal_places=2,
        validators=[MinValueValidator(Decimal("0.01"))],
        help_text="Parameters, in billions.",
    )
    dtype = models.CharField(max_length=8, choices=DType.choices, default=DType.BF16)
    weight_size_gib = models.FloatField(validators=[MinValueValidator(0.001)])
    max_context_tokens = models.PositiveIntegerField(
        validators=[MinValueValidator(256), MaxValueValidator(10_000_000)]
    )
    num_layers = models.PositiveIntegerField(validators=[MinValueValidator(1)])
    num_attention_heads = models.PositiveIntegerField(validators=[MinValueValidator(1)])
    num_kv_heads = models.PositiveIntegerField(validators=[MinValueValidator(1)])
    head_dim = models.PositiveIntegerField(validators=[MinValueValidator(1)])

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name


class LoraAdapter(TimeStampedModel):
    base_model = models.ForeignKey(LanguageModel, on_delete=models.PROTECT, related_name="adapters")
    name = models.CharField(
        max_length=128, validators=[LanguageModel._meta.get_field("name").validators[0]]
    )
    rank = models.PositiveSmallIntegerField(
        validators=[MinValueValidator(1), MaxValueValidator(512)]
    )
    source = models.CharField(
        max_length=500, help_text="Where the engine loads it from (path or URI); staff only."
    )
    #: A string reference: inventory imports no other domain (the tenancy app refers to it).
    owner = models.ForeignKey(
        "tenancy.Tenant",
        null=True,
        blank=True,
        on_delete=models.PROTECT,
        related_name="adapters",
        help_text="The tenant whose adapter this is: only it sees it and may send requests "
        "for it (other tenants get 404). Empty: a public adapter, offered to every tenant.",
    )

    class Meta:
        ordering = ["base_model__name", "name"]
        constraints = [
            models.UniqueConstraint(fields=["name"], name="loraadapter_unique_name"),
        ]

    def __str__(self) -> str:
        return self.name


class Deployment(TimeStampedModel):
    """A placement of a model on a pool: how many replicas, each with which TP size and role."""

    class Role(models.TextChoices):
        MIXED = "mixed", "Mixed (prefill and decode)"
        PREFILL = "prefill", "Prefill only"
        DECODE = "decode", "Decode only"

    model = models.ForeignKey(LanguageModel, on_delete=models.PROTECT, related_name="deployments")
    pool = models.ForeignKey(GPUPool, on_delete=models.PROTECT, related_name="deployments")
    role = models.CharField(max_length=8, choices=Role.choices, default=Role.MIXED)
    tensor_parallel_size = models.PositiveSmallIntegerField(
        validators=[MinValueValidator(1), MaxValueValidator(256)]
    )
    min_replicas = models.PositiveIntegerField(default=1)
    desired_replicas = models.PositiveIntegerField(default=1)
    max_replicas = models.PositiveIntegerField(default=1)
    autoscale = models.BooleanField(
        default=False,
        help_text="Let the fleet's autoscaler set desired_replicas within min and max from the "
        "load the edges report (docs/operations.md).",
    )
    scale_to_zero_after_s = models.PositiveIntegerField(
        null=True,
        blank=True,
        validators=[MinValueValidator(1), MaxValueValidator(7 * 24 * 3600)],
        help_text="Scale to zero after this many seconds without demand, and back from zero "
        "when an edge holds a request for it (needs autoscale and min_replicas 0; empty: never).",
    )
    engine_args = models.JSONField(
        default=dict,
        blank=True,
        help_text="Extra vLLM flags as {'flag-name': value}, e.g. {'max-num-seqs': 256}.",
    )
    adapters = models.ManyToManyField(LoraAdapter, blank=True, related_name="deployments")

    class Meta:
        ordering = ["pool__region__code", "pool__name", "model__name", "role"]
        constraints = [
            models.UniqueConstraint(fields=["model", "pool", "role"], name="deployment_unique"),
            models.CheckConstraint(
                condition=models.Q(min_replicas__lte=models.F("desired_replicas"))
                & models.Q(desired_replicas__lte=models.F("max_replicas")),
                name="deployment_replicas_ordered",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.model.name}@{self.pool}/{self.role}"


class Instance(TimeStampedModel):
    """One engine (replica) of a deployment. Its state changes only along legal transitions."""

    class State(models.TextChoices):
        PENDING = "pending", "Pending"
        LOADING = "loading", "Loading weights"
        WARMING = "warming", "Warming up"
        READY = "ready", "Ready"
        DRAINING = "draining", "Draining"
        STOPPED = "stopped", "Stopped"
        FAILED = "failed", "Failed"

    class DrainReason(models.TextChoices):
        NONE = "", "Not draining"
        OPERATOR = "operator", "Drained by an operator"
        EVACUATION = "evacuation", "Region evacuated"
        SCALE_DOWN = "scale_down", "Scaled down (stopped once idle)"

    deployment = models.ForeignKey(Deployment, on_delete=models.PROTECT, related_name="instances")
    name = models.CharField(max_length=63, unique=True, validators=[slug_validator])
    endpoint_url = models.CharField(max_length=300, unique=True, validators=[service_url_validator])
    state = models.CharField(max_length=16, choices=State.choices, default=State.PENDING)
    state_changed_at = models.DateTimeField(null=True, blank=True)
    drain_reason = models.CharField(
        max_length=16,
        choices=DrainReason.choices,
        blank=True,
        default="",
        help_text="Why a draining instance drains: restoring a region undrains only its own.",
    )
    last_heartbeat_at = models.DateTimeField(null=True, blank=True)
    load = models.JSONField(default=dict, blank=True, help_text="Last load snapshot from the edge.")

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name


class InstanceInterval(models.Model):
    """One stretch of an instance holding its GPUs: from the move into ``loading`` until it
    stopped or failed (``ended_at`` empty while it holds them), with the facts its cost is
    computed from as they were. Written by the lifecycle service on each transition; kept
    when the instance is deleted, so an hour recomputed later (a late record, a rollup rerun)
    is costed with the instances it really had, for the part of the hour each had them."""

    instance = models.ForeignKey(
        Instance, null=True, blank=True, on_delete=models.SET_NULL, related_name="intervals"
    )
    #: The instance's name (as usage records name it), kept when the instance is deleted.
    name = models.CharField(max_length=63)
    #: ``<region>/<pool>``, as in ``UsageRecord.pool``.
    pool = models.CharField(max_length=130)
    gpus = models.PositiveSmallIntegerField()
    prefill_tokens_per_s = models.FloatField()
    decode_tokens_per_s = models.FloatField()
    started_at = models.DateTimeField()
    ready_at = models.DateTimeField(null=True, blank=True)
    ended_at = models.DateTimeField(null=True, blank=True)
    #: ``stopped`` or ``failed`` once ended.
    end_state = models.CharField(max_length=16, blank=True, default="")

    class Meta:
        ordering = ["started_at", "id"]
        indexes = [models.Index(fields=["started_at", "ended_at"], name="interval_time")]
        constraints = [
            models.UniqueConstraint(
                fields=["instance"],
                condition=models.Q(ended_at__isnull=True),
                name="one_open_interval_per_instance",
            )
        ]

    def __str__(self) -> str:
        return f"{self.name} {self.started_at:%Y-%m-%d %H:%M} to {self.ended_at or ''}"


class PoolRevision(models.Model):
    """A GPU pool's size and price from ``effective_from`` on, as usage records name the pool
    (``<region>/<pool>``). Written by the pool services on creation, on every change of size,
    price or name, and on deletion (0 GPUs: gone); kept when the pool is deleted, so an hour
    is costed with the pool as it was during each part of it (``metering/fleet_hours.py``)."""

    pool = models.CharField(max_length=130)
    effective_from = models.DateTimeField()
    gpus = models.PositiveIntegerField()
    price_per_gpu_hour = models.DecimalField(max_digits=10, decimal_places=4)

    class Meta:
        ordering = ["pool", "effective_from", "id"]
        indexes = [models.Index(fields=["effective_from"], name="pool_revision_time")]

    def __str__(self) -> str:
        return f"{self.pool} from {self.effective_from:%Y-%m-%d %H:%M}: {self.gpus} GPUs"


class Edge(TimeStampedModel):
    """A registered edge router of a region."""

    region = models.ForeignKey(Region, on_delete=models.PROTECT, related_name="edges")
    name = models.CharField(max_length=63, unique=True, validators=[slug_validator])
    url = models.CharField(max_length=300, validators=[service_url_validator])
    last_heartbeat_at = models.DateTimeField(null=True, blank=True)
    applied_table_version = models.PositiveBigIntegerField(null=True, blank=True)
    workers = models.PositiveSmallIntegerField(
        default=1,
        help_text="Worker processes it runs on its port, as its heartbeats say (at most "
        "max_workers): each holds budget leases of its own and is one of the region's edges "
        "for rate-limit shares.",
    )
    max_workers = models.PositiveSmallIntegerField(
        default=DEFAULT_EDGE_MAX_WORKERS,
        validators=[MinValueValidator(1), MaxValueValidator(MAX_EDGE_WORKERS)],
        help_text="The most worker processes its heartbeats may claim (its --workers): a "
        "claim above it is clamped, and a worker above it is refused.",
    )
    cold_demand = models.JSONField(
        default=dict,
        blank=True,
        help_text="Its last report of requests for cold models (no ready instance): "
        "{model: {held, arrived, reported_at}}, what wakes a deployment scaled to zero.",
    )
    credential_hash = models.CharField(
        max_length=64,
        blank=True,
        default="",
        editable=False,
        db_index=True,
        help_text="SHA-256 of the edge's credential; the plaintext is shown once, at rotation.",
    )

    class Meta:
        ordering = ["region__code", "name"]

    def __str__(self) -> str:
        return self.name
