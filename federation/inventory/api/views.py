"""Inventory API views: each names its selector, input and output serializers and the one
service each write calls (``federation.api.views``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from django.db.models import Model, QuerySet
from drf_spectacular.utils import extend_schema, extend_schema_view
from rest_framework import status
from rest_framework.decorators import action
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.serializers import BaseSerializer

from federation.api.schema import crud_schema
from federation.api.views import ReadViewSet, ServiceViewSet
from federation.core.roles import is_staff_role
from federation.inventory import filters, selectors, services
from federation.inventory.api import serializers as s
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

# --- the public catalog: tenant viewers may read it ----------------------------------------


@crud_schema(out=s.RegionOutput, create=s.RegionCreateInput, update=s.RegionUpdateInput)
class RegionViewSet(ServiceViewSet):
    """Regions, addressed by their code."""

    tenant_viewer_readable = True
    lookup_field = "code"
    queryset = Region.objects.none()
    selector = staticmethod(selectors.region_list)
    output_serializer = s.RegionOutput
    create_input = s.RegionCreateInput
    update_input = s.RegionUpdateInput
    filterset_class = filters.RegionFilter
    ordering_fields = ("code", "name", "jurisdiction", "created_at")

    def create_object(self, data: dict[str, Any]) -> Model:
        return services.region_create(actor=self.request.user, **data)

    def update_object(self, obj: Region, data: Mapping[str, Any]) -> Model:
        return services.region_update(actor=self.request.user, region=obj, data=data)

    def delete_object(self, obj: Region) -> None:
        services.region_delete(actor=self.request.user, region=obj)

    @extend_schema(request=None, responses={200: s.RegionOutput})
    @action(detail=True, methods=["post"])
    def evacuate(self, request: Request, code: str | None = None) -> Response:
        """Take the region out of traffic and drain its ready instances."""
        return self.respond(services.region_evacuate(actor=request.user, region=self.get_object()))

    @extend_schema(request=None, responses={200: s.RegionOutput})
    @action(detail=True, methods=["post"])
    def restore(self, request: Request, code: str | None = None) -> Response:
        """Put the region back into traffic and undrain what its evacuation drained."""
        return self.respond(services.region_restore(actor=request.user, region=self.get_object()))


@extend_schema_view(
    create=extend_schema(
        request=s.RegionLinkSetInput,
        responses={201: s.RegionLinkOutput, 200: s.RegionLinkOutput},
        description="Set the RTT of a pair: 201 when the pair is new, 200 when it is updated.",
    )
)
@crud_schema(out=s.RegionLinkOutput, create=s.RegionLinkSetInput, update=s.RegionLinkUpdateInput)
class RegionLinkViewSet(ServiceViewSet):
    """The inter-region RTT matrix. POSTing an existing pair updates it."""

    tenant_viewer_readable = True
    queryset = RegionLink.objects.none()
    selector = staticmethod(selectors.region_link_list)
    output_serializer = s.RegionLinkOutput
    create_input = s.RegionLinkSetInput
    update_input = s.RegionLinkUpdateInput
    filterset_class = filters.RegionLinkFilter
    ordering_fields = ("rtt_ms", "measured_rtt_ms", "created_at")

    def create(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        ser = self.create_input(data=request.data)
        ser.is_valid(raise_exception=True)
        link, created = services.region_link_set(actor=request.user, **ser.validated_data)
        return self.respond(link, status.HTTP_201_CREATED if created else status.HTTP_200_OK)

    def update_object(self, obj: RegionLink, data: Mapping[str, Any]) -> Model:
        return services.region_link_update(actor=self.request.user, link=obj, data=data)

    def delete_object(self, obj: RegionLink) -> None:
        services.region_link_delete(actor=self.request.user, link=obj)


class AcceleratorTypeViewSet(ReadViewSet):
    """The accelerator catalog (read-only; seeded by a migration)."""

    tenant_viewer_readable = True
    queryset = AcceleratorType.objects.none()
    selector = staticmethod(selectors.accelerator_type_list)
    output_serializer = s.AcceleratorTypeOutput
    filterset_class = filters.AcceleratorTypeFilter
    ordering_fields = ("name", "memory_gib", "relative_speed")


@crud_schema(out=s.LanguageModelOutput, create=s.LanguageModelInput, update=s.LanguageModelInput)
class LanguageModelViewSet(ServiceViewSet):
    """Base models clients can ask for."""

    tenant_viewer_readable = True
    queryset = LanguageModel.objects.none()
    selector = staticmethod(selectors.model_list)
    output_serializer = s.LanguageModelOutput
    create_input = s.LanguageModelInput
    update_input = s.LanguageModelInput
    filterset_class = filters.LanguageModelFilter
    ordering_fields = ("name", "parameter_count_b", "max_context_tokens", "created_at")

    def create_object(self, data: dict[str, Any]) -> Model:
        return services.model_create(actor=self.request.user, **data)

    def update_object(self, obj: LanguageModel, data: Mapping[str, Any]) -> Model:
        return services.model_update(actor=self.request.user, model=obj, data=data)

    def delete_object(self, obj: LanguageModel) -> None:
        services.model_delete(actor=self.request.user, model=obj)


@crud_schema(out=s.AdapterOutput, create=s.AdapterInput, update=s.AdapterInput)
class AdapterViewSet(ServiceViewSet):
    """LoRA adapters of base models. A tenant viewer sees the public ones and its tenant's
    own, never their ``source``; another tenant's is a 404."""

    tenant_viewer_readable = True
    queryset = LoraAdapter.objects.none()
    selector = staticmethod(selectors.adapter_list)
    output_serializer = s.AdapterOutput
    create_input = s.AdapterInput
    update_input = s.AdapterInput
    filterset_class = filters.AdapterFilter
    ordering_fields = ("name", "rank", "created_at")

    def get_queryset(self) -> QuerySet[LoraAdapter]:
        return selectors.adapters_visible_to(user=self.request.user)

    def get_serializer_class(self) -> type[BaseSerializer]:
        if is_staff_role(self.request.user):
            return s.AdapterOutput
        return s.AdapterTenantOutput

    def create_object(self, data: dict[str, Any]) -> Model:
        return services.adapter_create(actor=self.request.user, **data)

    def update_object(self, obj: LoraAdapter, data: Mapping[str, Any]) -> Model:
        return services.adapter_update(actor=self.request.user, adapter=obj, data=data)

    def delete_object(self, obj: LoraAdapter) -> None:
        services.adapter_delete(actor=self.request.user, adapter=obj)


# --- the fleet: staff only -----------------------------------------------------------------


@crud_schema(out=s.PoolOutput, create=s.PoolCreateInput, update=s.PoolUpdateInput)
class PoolViewSet(ServiceViewSet):
    """GPU pools with their capacity (total, claimed by deployments, free)."""

    queryset = GPUPool.objects.none()
    selector = staticmethod(selectors.pool_list)
    output_serializer = s.PoolOutput
    create_input = s.PoolCreateInput
    update_input = s.PoolUpdateInput
    filterset_class = filters.PoolFilter
    ordering_fields = ("name", "price_per_gpu_hour", "free_gpus", "node_count", "created_at")

    def create_object(self, data: dict[str, Any]) -> Model:
        return services.pool_create(actor=self.request.user, **data)

    def update_object(self, obj: GPUPool, data: Mapping[str, Any]) -> Model:
        return services.pool_update(actor=self.request.user, pool=obj, data=data)

    def delete_object(self, obj: GPUPool) -> None:
        services.pool_delete(actor=self.request.user, pool=obj)

    @extend_schema(request=None, responses={200: s.PoolOutput})
    @action(detail=True, methods=["post"])
    def cordon(self, request: Request, pk: str | None = None) -> Response:
        """No new deployments or replicas on this pool; running ones keep serving."""
        return self.respond(services.pool_cordon(actor=request.user, pool=self.get_object()))

    @extend_schema(request=None, responses={200: s.PoolOutput})
    @action(detail=True, methods=["post"])
    def uncordon(self, request: Request, pk: str | None = None) -> Response:
        """Let the pool take new deployments and replicas again."""
        return self.respond(services.pool_uncordon(actor=request.user, pool=self.get_object()))


@crud_schema(out=s.DeploymentOutput, create=s.DeploymentCreateInput, update=s.DeploymentUpdateInput)
class DeploymentViewSet(ServiceViewSet):
    """Placements of models on pools; every write is checked against the pool (fit.py)."""

    queryset = Deployment.objects.none()
    selector = staticmethod(selectors.deployment_list)
    output_serializer = s.DeploymentOutput
    create_input = s.DeploymentCreateInput
    update_input = s.DeploymentUpdateInput
    filterset_class = filters.DeploymentFilter
    ordering_fields = ("desired_replicas", "tensor_parallel_size", "created_at")

    def create_object(self, data: dict[str, Any]) -> Model:
        return services.deployment_create(actor=self.request.user, **data)

    def update_object(self, obj: Deployment, data: Mapping[str, Any]) -> Model:
        return services.deployment_update(actor=self.request.user, deployment=obj, data=data)

    def delete_object(self, obj: Deployment) -> None:
        services.deployment_delete(actor=self.request.user, deployment=obj)


@crud_schema(out=s.InstanceOutput, create=s.InstanceCreateInput, update=s.InstanceUpdateInput)
class InstanceViewSet(ServiceViewSet):
    """Engine replicas; their state moves only along the lifecycle (lifecycle.py)."""

    queryset = Instance.objects.none()
    selector = staticmethod(selectors.instance_list)
    output_serializer = s.InstanceOutput
    create_input = s.InstanceCreateInput
    update_input = s.InstanceUpdateInput
    filterset_class = filters.InstanceFilter
    ordering_fields = ("name", "state", "state_changed_at", "last_heartbeat_at", "created_at")

    def create_object(self, data: dict[str, Any]) -> Model:
        return services.instance_create(actor=self.request.user, **data)

    def update_object(self, obj: Instance, data: Mapping[str, Any]) -> Model:
        return services.instance_update(actor=self.request.user, instance=obj, data=data)

    def delete_object(self, obj: Instance) -> None:
        services.instance_delete(actor=self.request.user, instance=obj)

    @extend_schema(request=None, responses={200: s.InstanceOutput})
    @action(detail=True, methods=["post"])
    def drain(self, request: Request, pk: str | None = None) -> Response:
        """Stop routing new requests to this ready instance."""
        return self.respond(services.instance_drain(actor=request.user, instance=self.get_object()))

    @extend_schema(request=None, responses={200: s.InstanceOutput})
    @action(detail=True, methods=["post"])
    def undrain(self, request: Request, pk: str | None = None) -> Response:
        """Route new requests to this draining instance again."""
        return self.respond(
            services.instance_undrain(actor=request.user, instance=self.get_object())
        )

    @extend_schema(request=s.InstanceTransitionInput, responses={200: s.InstanceOutput})
    @action(detail=True, methods=["post"])
    def transition(self, request: Request, pk: str | None = None) -> Response:
        """Move the instance along a legal lifecycle transition (409 lists the legal ones)."""
        instance = self.get_object()
        ser = s.InstanceTransitionInput(data=request.data)
        ser.is_valid(raise_exception=True)
        return self.respond(
            services.instance_transition(
                actor=request.user, instance=instance, state=ser.validated_data["state"]
            )
        )


@crud_schema(out=s.EdgeOutput, create=s.EdgeCreateInput, update=s.EdgeUpdateInput)
class EdgeViewSet(ServiceViewSet):
    """Edge routers registered per region."""

    queryset = Edge.objects.none()
    selector = staticmethod(selectors.edge_list)
    output_serializer = s.EdgeOutput
    create_input = s.EdgeCreateInput
    update_input = s.EdgeUpdateInput
    filterset_class = filters.EdgeFilter
    ordering_fields = ("name", "last_heartbeat_at", "applied_table_version", "created_at")

    def create_object(self, data: dict[str, Any]) -> Model:
        return services.edge_register(actor=self.request.user, **data)

    def update_object(self, obj: Edge, data: Mapping[str, Any]) -> Model:
        return services.edge_update(actor=self.request.user, edge=obj, data=data)

    def delete_object(self, obj: Edge) -> None:
        services.edge_delete(actor=self.request.user, edge=obj)
