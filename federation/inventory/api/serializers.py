"""Input and output shapes of the inventory API.

Inputs refuse unknown fields (``StrictFieldsMixin``) and only check shapes and single-field
rules; cross-row rules live in the services. Outputs are read-only and name related objects
the way clients refer to them (region codes, accelerator names) next to their ids.
"""

from __future__ import annotations

from typing import Any

from rest_framework import serializers

from federation.api.serializers import StrictFieldsMixin
from federation.inventory import fit
from federation.inventory.models import (
    AcceleratorType,
    Deployment,
    Edge,
    GPUPool,
    Instance,
    LanguageModel,
    LoraAdapter,
    Region,
    RegionLink,
)
from federation.inventory.services import MODEL_UPDATABLE

TIMESTAMPS = ("created_at", "updated_at")


class ReadOnlyModelSerializer(serializers.ModelSerializer):
    def get_fields(self) -> dict[str, serializers.Field]:
        fields = super().get_fields()
        for field in fields.values():
            field.read_only = True
        return fields


class StrictCharField(serializers.CharField):
    """JSON strings only: DRF would store ``{"name": 0}`` as "0"."""

    def to_internal_value(self, data: Any) -> Any:
        if not isinstance(data, str):
            self.fail("invalid")
        return super().to_internal_value(data)


class StrictBooleanField(serializers.BooleanField):
    """JSON true and false only: DRF would take "yes", "on" and 1."""

    def to_internal_value(self, data: Any) -> Any:
        if not isinstance(data, bool):
            self.fail("invalid", input=data)
        return data


# Numbers are already held to JSON numbers by StrictFieldsMixin.
_STRICT = {
    serializers.CharField: StrictCharField,
    serializers.BooleanField: StrictBooleanField,
}


class InputSerializer(StrictFieldsMixin, serializers.ModelSerializer):
    """Base of input bodies: unknown fields and loosely typed JSON values are refused."""

    serializer_field_mapping = {
        model_field: _STRICT.get(field, field)
        for model_field, field in serializers.ModelSerializer.serializer_field_mapping.items()
    }


class SlugLookupField(serializers.SlugRelatedField):
    """A SlugRelatedField that refuses NUL characters itself: PostgreSQL cannot even compare
    text containing them, so the lookup would fail with a server error."""

    def to_internal_value(self, data: Any) -> Any:
        if isinstance(data, str) and "\x00" in data:
            raise serializers.ValidationError("Null characters are not allowed.")
        return super().to_internal_value(data)


def _region_field(help_text: str = "Region code.") -> SlugLookupField:
    return SlugLookupField(slug_field="code", queryset=Region.objects.all(), help_text=help_text)


# --- regions -------------------------------------------------------------------------------


class RegionOut(ReadOnlyModelSerializer):
    class Meta:
        model = Region
        fields = (
            "id",
            "code",
            "name",
            "provider",
            "latitude",
            "longitude",
            "jurisdiction",
            "status",
            *TIMESTAMPS,
        )


class RegionCreateIn(InputSerializer):
    class Meta:
        model = Region
        fields = ("code", "name", "provider", "latitude", "longitude", "jurisdiction")


class RegionUpdateIn(InputSerializer):
    class Meta:
        model = Region
        fields = ("name", "provider", "latitude", "longitude", "jurisdiction", "status")
        extra_kwargs = {
            "status": {
                "help_text": "active or cordoned; the evacuate and restore actions move a "
                "region in and out of 'evacuated'."
            }
        }


class RegionLinkOut(ReadOnlyModelSerializer):
    # A field named 'source' shadows Field.source only in the stubs; DRF's metaclass moves
    # declared fields off the class.
    source = serializers.CharField(source="source.code", read_only=True)  # type: ignore[assignment]
    target = serializers.CharField(source="target.code", read_only=True)

    class Meta:
        model = RegionLink
        fields = ("id", "source", "target", "rtt_ms", "measured_rtt_ms", *TIMESTAMPS)


class RegionLinkSetIn(InputSerializer):
    source = _region_field("Source region code.")  # type: ignore[assignment]
    target = _region_field("Target region code.")

    class Meta:
        model = RegionLink
        fields = ("source", "target", "rtt_ms", "measured_rtt_ms")
        validators: list[Any] = []  # posting an existing pair updates it (upsert)


class RegionLinkUpdateIn(InputSerializer):
    class Meta:
        model = RegionLink
        fields = ("rtt_ms", "measured_rtt_ms")


class AcceleratorTypeOut(ReadOnlyModelSerializer):
    class Meta:
        model = AcceleratorType
        fields = (
            "id",
            "name",
            "vendor",
            "memory_gib",
            "relative_speed",
            "memory_bandwidth_gbps",
            "supports_nvlink",
        )


# --- pools ---------------------------------------------------------------------------------

POOL_FIELDS = (
    "name",
    "accelerator",
    "gpus_per_node",
    "node_count",
    "interconnect",
    "rdma",
    "price_per_gpu_hour",
    "capacity_type",
    "gpu_memory_utilization",
)


class PoolOut(ReadOnlyModelSerializer):
    region = serializers.CharField(source="region.code", read_only=True)
    accelerator = serializers.CharField(source="accelerator.name", read_only=True)
    total_gpus = serializers.IntegerField(read_only=True)
    used_gpus = serializers.IntegerField(
        read_only=True, help_text="Claimed by deployments: desired replicas x TP."
    )
    free_gpus = serializers.IntegerField(read_only=True)

    class Meta:
        model = GPUPool
        fields = (
            "id",
            "region",
            *POOL_FIELDS,
            "total_gpus",
            "used_gpus",
            "free_gpus",
            "status",
            *TIMESTAMPS,
        )


class PoolCreateIn(InputSerializer):
    region = _region_field()
    accelerator = SlugLookupField(
        slug_field="name",
        queryset=AcceleratorType.objects.all(),
        help_text="Accelerator type name, e.g. 'H100-80G'.",
    )

    class Meta:
        model = GPUPool
        fields = ("region", *POOL_FIELDS)


class PoolUpdateIn(PoolCreateIn):
    class Meta:
        model = GPUPool
        fields = POOL_FIELDS


# --- models and adapters -------------------------------------------------------------------

# The fields a model is created and updated with are the ones its service accepts.
MODEL_FIELDS = MODEL_UPDATABLE


class LanguageModelOut(ReadOnlyModelSerializer):
    class Meta:
        model = LanguageModel
        fields = ("id", *MODEL_FIELDS, *TIMESTAMPS)


class LanguageModelIn(InputSerializer):
    class Meta:
        model = LanguageModel
        fields = MODEL_FIELDS


class AdapterOut(ReadOnlyModelSerializer):
    base_model_name = serializers.CharField(source="base_model.name", read_only=True)

    class Meta:
        model = LoraAdapter
        fields = ("id", "base_model", "base_model_name", "name", "rank", "source", *TIMESTAMPS)


class AdapterIn(InputSerializer):
    class Meta:
        model = LoraAdapter
        fields = ("base_model", "name", "rank", "source")


# --- deployments ---------------------------------------------------------------------------

DEPLOYMENT_TUNABLE = (
    "tensor_parallel_size",
    "min_replicas",
    "desired_replicas",
    "max_replicas",
    "engine_args",
    "adapters",
)


class DeploymentOut(ReadOnlyModelSerializer):
    model_name = serializers.CharField(source="model.name", read_only=True)
    pool_name = serializers.CharField(source="pool.name", read_only=True)
    region = serializers.CharField(source="pool.region.code", read_only=True)
    gpus = serializers.SerializerMethodField(help_text="GPUs claimed: desired replicas x TP.")

    class Meta:
        model = Deployment
        fields = (
            "id",
            "model",
            "model_name",
            "pool",
            "pool_name",
            "region",
            "role",
            *DEPLOYMENT_TUNABLE,
            "gpus",
            *TIMESTAMPS,
        )

    def get_gpus(self, obj: Deployment) -> int:
        return fit.deployment_gpus(
            tensor_parallel_size=obj.tensor_parallel_size, desired_replicas=obj.desired_replicas
        )


class DeploymentUpdateIn(InputSerializer):
    engine_args = serializers.DictField(
        required=False,
        help_text="Extra vLLM flags without leading dashes, e.g. {'max-num-seqs': 256}.",
    )
    adapters = serializers.PrimaryKeyRelatedField(
        many=True,
        required=False,
        queryset=LoraAdapter.objects.select_related("base_model"),
        help_text="Ids of LoRA adapters of the deployment's model.",
    )

    class Meta:
        model = Deployment
        fields = DEPLOYMENT_TUNABLE


class DeploymentCreateIn(DeploymentUpdateIn):
    class Meta:
        model = Deployment
        fields = ("model", "pool", "role", *DEPLOYMENT_TUNABLE)
        validators: list[Any] = []  # the service reports a duplicate with the fit problems


# --- instances and edges -------------------------------------------------------------------


class InstanceOut(ReadOnlyModelSerializer):
    model_name = serializers.CharField(source="deployment.model.name", read_only=True)
    region = serializers.CharField(source="deployment.pool.region.code", read_only=True)

    class Meta:
        model = Instance
        fields = (
            "id",
            "deployment",
            "model_name",
            "region",
            "name",
            "endpoint_url",
            "state",
            "drain_reason",
            "state_changed_at",
            "last_heartbeat_at",
            "load",
            *TIMESTAMPS,
        )


class InstanceCreateIn(InputSerializer):
    class Meta:
        model = Instance
        fields = ("deployment", "name", "endpoint_url")


class InstanceUpdateIn(InputSerializer):
    load = serializers.DictField(required=False, help_text="Last load snapshot.")

    class Meta:
        model = Instance
        fields = ("endpoint_url", "last_heartbeat_at", "load")


class InstanceTransitionIn(StrictFieldsMixin, serializers.Serializer):
    state = serializers.ChoiceField(choices=Instance.State.choices)


class EdgeOut(ReadOnlyModelSerializer):
    region = serializers.CharField(source="region.code", read_only=True)

    class Meta:
        model = Edge
        fields = (
            "id",
            "region",
            "name",
            "url",
            "last_heartbeat_at",
            "applied_table_version",
            *TIMESTAMPS,
        )


class EdgeCreateIn(InputSerializer):
    region = _region_field()

    class Meta:
        model = Edge
        fields = ("region", "name", "url")


class EdgeUpdateIn(InputSerializer):
    class Meta:
        model = Edge
        fields = ("url", "last_heartbeat_at", "applied_table_version")
