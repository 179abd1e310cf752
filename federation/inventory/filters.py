"""Query-string filters of the inventory API (``?region=us-east&status=active``)."""

from __future__ import annotations

import django_filters as df

from federation.api.filters import IntegerFilter, StrictFilterSet
from federation.inventory.models import (
    AcceleratorType,
    Deployment,
    Edge,
    GPUPool,
    Instance,
    Jurisdiction,
    LanguageModel,
    LoraAdapter,
    Region,
    RegionLink,
)


class RegionFilter(StrictFilterSet):
    jurisdiction = df.MultipleChoiceFilter(choices=Jurisdiction.choices)
    status = df.MultipleChoiceFilter(choices=Region.Status.choices)

    class Meta:
        model = Region
        fields = ["jurisdiction", "provider", "status"]


class RegionLinkFilter(StrictFilterSet):
    source = df.CharFilter(field_name="source__code", help_text="Source region code.")
    target = df.CharFilter(field_name="target__code", help_text="Target region code.")

    class Meta:
        model = RegionLink
        fields = ["source", "target"]


class AcceleratorTypeFilter(StrictFilterSet):
    min_memory_gib = IntegerFilter(field_name="memory_gib", lookup_expr="gte")

    class Meta:
        model = AcceleratorType
        fields = ["vendor", "name", "supports_nvlink"]


class PoolFilter(StrictFilterSet):
    region = df.CharFilter(field_name="region__code", help_text="Region code.")
    accelerator = df.CharFilter(field_name="accelerator__name", help_text="Accelerator name.")
    jurisdiction = df.ChoiceFilter(field_name="region__jurisdiction", choices=Jurisdiction.choices)
    min_free_gpus = IntegerFilter(
        field_name="free_gpus", lookup_expr="gte", help_text="At least this many unclaimed GPUs."
    )

    class Meta:
        model = GPUPool
        fields = ["region", "accelerator", "status", "capacity_type", "interconnect", "rdma"]


class LanguageModelFilter(StrictFilterSet):
    name = df.CharFilter(lookup_expr="icontains")

    class Meta:
        model = LanguageModel
        fields = ["name", "family", "dtype"]


class AdapterFilter(StrictFilterSet):
    class Meta:
        model = LoraAdapter
        fields = ["base_model"]


class DeploymentFilter(StrictFilterSet):
    region = df.CharFilter(field_name="pool__region__code", help_text="Region code.")

    class Meta:
        model = Deployment
        fields = ["model", "pool", "region", "role"]


class InstanceFilter(StrictFilterSet):
    state = df.MultipleChoiceFilter(choices=Instance.State.choices)
    region = df.CharFilter(field_name="deployment__pool__region__code", help_text="Region code.")
    model = IntegerFilter(field_name="deployment__model", help_text="Model id.")

    class Meta:
        model = Instance
        fields = ["state", "deployment", "region", "model"]


class EdgeFilter(StrictFilterSet):
    region = df.CharFilter(field_name="region__code", help_text="Region code.")

    class Meta:
        model = Edge
        fields = ["region"]
