"""Input and output shapes of the inventory API.

Inputs refuse unknown fields (``federation.api.serializers``) and only check shapes and
single-field rules; cross-row rules live in the services. Outputs are read-only and name
related objects the way clients refer to them (region codes, accelerator names) next to their
ids.
"""

from __future__ import annotations

from typing import Any

from rest_framework import serializers

from federation.api.fields import SlugLookupField
from federation.api.serializers import InputSerializer, ModelInputSerializer, OutputModelSerializer
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
from federation.inventory.services import DEPLOYMENT_UPDATABLE, MODEL_UPDATABLE, POOL_UPDATABLE

TIMESTAMPS = ("created_at", "updated_at")


def _region_field(help_text: str = "Region code.") -> SlugLookupField:
    return SlugLookupField(slug_field="code", queryset=Region.objects.all(), help_text=help_text)


# --- regions -------------------------------------------------------------------------------


class RegionOutput(OutputModelSerializer):
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


class RegionCreateInput(ModelInputSerializer):
    class Meta:
        model = Region
        fields = ("code", "name", "provider", "latitude", "longitude", "jurisdiction")


class RegionUpdateInput(ModelInputSerializer):
    class Meta:
        model = Region
        fields = ("name", "provider", "latitude", "longitude", "jurisdiction", "status")
        extra_kwargs = {
            "status": {
                "help_text": "active or cordoned; the evacuate and restore actions move a "
                "region in and out of 'evacuated'."
            }
        }


class RegionLinkOutput(OutputModelSerializer):
    # A field named 'source' shadows Field.source only in the stubs; DRF's metaclass moves
    # declared fields off the class.
    source = serializers.CharField(source="source.code", read_only=True)  # type: ignore[assignment]
    target = serializers.CharField(source="target.code", read_only=True)

    class Meta:
        model = RegionLink
        fields = ("id", "source", "target", "rtt_ms", "measured_rtt_ms", *TIMESTAMPS)


class RegionLinkSetInput(ModelInputSerializer):
    source = _region_field("Source region code.")  # type: ignore[assignment]
    target = _region_field("Target region code.")

    class Meta:
        model = RegionLink
        fields = ("source", "target", "rtt_ms", "measured_rtt_ms")
        validators: list[Any] = []  # posting an existing pair updates it (upsert)


class RegionLinkUpdateInput(ModelInputSerializer):
    class Meta:
        model = RegionLink
        fields = ("rtt_ms", "measured_rtt_ms")


class AcceleratorTypeOutput(OutputModelSerializer):
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

# The fields a pool is created and updated with are the ones its service accepts.
POOL_FIELDS = POOL_UPDATABLE


class PoolOutput(OutputModelSerializer):
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


class PoolCreateInput(ModelInputSerializer):
    region = _region_field()
    accelerator = SlugLookupField(
        slug_field="name",
        queryset=AcceleratorType.objects.all(),
        help_text="Accelerator type name, e.g. 'H100-80G'.",
    )

    class Meta:
        model = GPUPool
        fields = ("region", *POOL_FIELDS)


class PoolUpdateInput(PoolCreateInput):
    class Meta:
        model = GPUPool
        fields = POOL_FIELDS


# --- models and adapters -------------------------------------------------------------------

# The fields a model is created and updated with are the ones its service accepts.
MODEL_FIELDS = MODEL_UPDATABLE


class LanguageModelOutput(OutputModelSerializer):
    class Meta:
        model = LanguageModel
        fields = ("id", *MODEL_FIELDS, *TIMESTAMPS)


class LanguageModelInput(ModelInputSerializer):
    class Meta:
        model = LanguageModel
        fields = MODEL_FIELDS


#: The tenant model, by the owner field: inventory imports no other domain.
_TENANTS: Any = LoraAdapter._meta.get_field("owner").related_model
ADAPTER_OWNER_HELP = (
    "Slug of the tenant whose adapter this is: only it sees it and may use it (other tenants "
    "get 404). Null: public, offered to every tenant."
)


class AdapterOutput(OutputModelSerializer):
    """An adapter as staff see it. Tenant viewers get :class:`AdapterTenantOutput`."""

    base_model_name = serializers.CharField(source="base_model.name", read_only=True)
    owner: serializers.SlugRelatedField[Any] = serializers.SlugRelatedField(
        read_only=True, slug_field="slug", allow_null=True, help_text=ADAPTER_OWNER_HELP
    )

    class Meta:
        model = LoraAdapter
        fields: tuple[str, ...] = (
            "id",
            "base_model",
            "base_model_name",
            "name",
            "rank",
            "owner",
            "source",
            *TIMESTAMPS,
        )
        extra_kwargs = {"source": {"help_text": "Where the engine loads it from; staff only."}}


class AdapterTenantOutput(AdapterOutput):
    """An adapter as a tenant viewer sees it: never where it is stored (``source``)."""

    class Meta(AdapterOutput.Meta):
        fields = tuple(f for f in AdapterOutput.Meta.fields if f != "source")


class AdapterInput(ModelInputSerializer):
    owner = SlugLookupField(
        slug_field="slug",
        queryset=_TENANTS.objects.all(),
        allow_null=True,
        required=False,
        help_text=ADAPTER_OWNER_HELP,
    )

    class Meta:
        model = LoraAdapter
        fields = ("base_model", "name", "rank", "source", "owner")


# --- deployments ---------------------------------------------------------------------------

DEPLOYMENT_TUNABLE = (*DEPLOYMENT_UPDATABLE, "adapters")


class DeploymentOutput(OutputModelSerializer):
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


class DeploymentUpdateInput(ModelInputSerializer):
    engine_args = serializers.DictField(
        required=False,
        help_text="Extra vLLM flags without leading dashes, e.g. {'max-num-seqs': 256}: "
        "only flags of the allowlist (docs/operations.md, 'Engine flags'), each with a value "
        "of its type; those that run foreign code (trust-remote-code...) only by an admin.",
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


class DeploymentCreateInput(DeploymentUpdateInput):
    class Meta:
        model = Deployment
        fields = ("model", "pool", "role", *DEPLOYMENT_TUNABLE)
        validators: list[Any] = []  # the service reports a duplicate with the fit problems


# --- instances and edges -------------------------------------------------------------------


class InstanceOutput(OutputModelSerializer):
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


class InstanceCreateInput(ModelInputSerializer):
    class Meta:
        model = Instance
        fields = ("deployment", "name", "endpoint_url")


class InstanceUpdateInput(ModelInputSerializer):
    load = serializers.DictField(required=False, help_text="Last load snapshot.")

    class Meta:
        model = Instance
        fields = ("endpoint_url", "last_heartbeat_at", "load")


class InstanceTransitionInput(InputSerializer):
    state = serializers.ChoiceField(choices=Instance.State.choices)


class EdgeOutput(OutputModelSerializer):
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
            "workers",
            "max_workers",
            *TIMESTAMPS,
        )


class EdgeCreateInput(ModelInputSerializer):
    region = _region_field()

    class Meta:
        model = Edge
        fields = ("region", "name", "url", "max_workers")


class EdgeUpdateInput(ModelInputSerializer):
    class Meta:
        model = Edge
        fields = ("url", "last_heartbeat_at", "applied_table_version", "max_workers")
