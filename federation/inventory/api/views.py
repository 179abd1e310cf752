"""Inventory API views: load, validate the shape, call one service, render the result.

Each viewset names its input and output serializers; writes never touch ``save()`` here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, ClassVar

from django.db.models import Model, QuerySet
from drf_spectacular.utils import extend_schema, extend_schema_view
from rest_framework import mixins, status, viewsets
from rest_framework.decorators import action
from rest_framework.exceptions import NotFound
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.serializers import BaseSerializer

from federation.inventory import filters, selectors, services
from federation.inventory.api import serializers as s
from federation.inventory.api.schema import InventoryAutoSchema
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


def crud_schema(
    *, out: type[BaseSerializer], create: type[BaseSerializer], update: type[BaseSerializer]
) -> Callable[[type], type]:
    """Document that writes take the input serializer and answer with the output one."""
    return extend_schema_view(
        create=extend_schema(request=create, responses={201: out}),
        update=extend_schema(request=update, responses={200: out}),
        partial_update=extend_schema(request=update, responses={200: out}),
    )


class ReadViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet):
    """List and retrieve through a selector and the output serializer."""

    schema = InventoryAutoSchema()
    # Anything up to the next slash reaches the view, so a malformed id is a JSON 404 from
    # the view rather than Django's HTML 404 from the URL resolver.
    lookup_value_regex = r"[^/]+"
    output_serializer: ClassVar[type[BaseSerializer]]
    selector: ClassVar[Callable[[], QuerySet[Any]]]

    def get_queryset(self) -> QuerySet[Any]:
        return type(self).selector()

    def get_serializer_class(self) -> type[BaseSerializer]:
        return self.output_serializer

    def get_object(self) -> Any:
        # PostgreSQL cannot compare text holding NUL; such a key matches nothing.
        if "\x00" in str(self.kwargs.get(self.lookup_url_kwarg or self.lookup_field, "")):
            raise NotFound()
        return super().get_object()

    def respond(self, obj: Model, code: int = status.HTTP_200_OK) -> Response:
        """Render ``obj`` re-read through the selector (fresh annotations and relations)."""
        fresh = self.get_queryset().get(pk=obj.pk)
        return Response(self.output_serializer(fresh).data, status=code)


class ServiceViewSet(mixins.DestroyModelMixin, ReadViewSet):
    """CRUD where create, update and delete each call one service."""

    create_input: ClassVar[type[BaseSerializer]]
    update_input: ClassVar[type[BaseSerializer]]

    def create_object(self, data: dict[str, Any]) -> Model:
        raise NotImplementedError

    def update_object(self, obj: Any, data: Mapping[str, Any]) -> Model:
        raise NotImplementedError

    def delete_object(self, obj: Any) -> None:
        raise NotImplementedError

    def create(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        ser = self.create_input(data=request.data)
        ser.is_valid(raise_exception=True)
        return self.respond(self.create_object(dict(ser.validated_data)), status.HTTP_201_CREATED)

    def update(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        obj = self.get_object()
        ser = self.update_input(obj, data=request.data, partial=kwargs.get("partial", False))
        ser.is_valid(raise_exception=True)
        return self.respond(self.update_object(obj, dict(ser.validated_data)))

    def partial_update(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        return self.update(request, *args, partial=True, **kwargs)

    def perform_destroy(self, instance: Any) -> None:
        self.delete_object(instance)


# --- the public catalog: tenant viewers may read it ----------------------------------------


@crud_schema(out=s.RegionOut, create=s.RegionCreateIn, update=s.RegionUpdateIn)
class RegionViewSet(ServiceViewSet):
    """Regions, addressed by their code."""

    tenant_viewer_readable = True
    lookup_field = "code"
    queryset = Region.objects.none()
    selector = staticmethod(selectors.region_list)
    output_serializer = s.RegionOut
    create_input = s.RegionCreateIn
    update_input = s.RegionUpdateIn
    filterset_class = filters.RegionFilter
    ordering_fields = ("code", "name", "jurisdiction", "created_at")

    def create_object(self, data: dict[str, Any]) -> Model:
        return services.region_create(actor=self.request.user, **data)

    def update_object(self, obj: Region, data: Mapping[str, Any]) -> Model:
        return services.region_update(actor=self.request.user, region=obj, data=data)

    def delete_object(self, obj: Region) -> None:
        services.region_delete(actor=self.request.user, region=obj)

    @extend_schema(request=None, responses={200: s.RegionOut})
    @action(detail=True, methods=["post"])
    def evacuate(self, request: Request, code: str | None = None) -> Response:
        """Take the region out of traffic and drain its ready instances."""
        return self.respond(services.region_evacuate(actor=request.user, region=self.get_object()))

    @extend_schema(request=None, responses={200: s.RegionOut})
    @action(detail=True, methods=["post"])
    def restore(self, request: Request, code: str | None = None) -> Response:
        """Put the region back into traffic and undrain what its evacuation drained."""
        return self.respond(services.region_restore(actor=request.user, region=self.get_object()))


@extend_schema_view(
    create=extend_schema(
        request=s.RegionLinkSetIn,
        responses={201: s.RegionLinkOut, 200: s.RegionLinkOut},
        description="Set the RTT of a pair: 201 when the pair is new, 200 when it is updated.",
    )
)
@crud_schema(out=s.RegionLinkOut, create=s.RegionLinkSetIn, update=s.RegionLinkUpdateIn)
class RegionLinkViewSet(ServiceViewSet):
    """The inter-region RTT matrix. POSTing an existing pair updates it."""

    tenant_viewer_readable = True
    queryset = RegionLink.objects.none()
    selector = staticmethod(selectors.region_link_list)
    output_serializer = s.RegionLinkOut
    create_input = s.RegionLinkSetIn
    update_input = s.RegionLinkUpdateIn
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
    output_serializer = s.AcceleratorTypeOut
    filterset_class = filters.AcceleratorTypeFilter
    ordering_fields = ("name", "memory_gib", "relative_speed")


@crud_schema(out=s.LanguageModelOut, create=s.LanguageModelIn, update=s.LanguageModelIn)
class LanguageModelViewSet(ServiceViewSet):
    """Base models clients can ask for."""

    tenant_viewer_readable = True
    queryset = LanguageModel.objects.none()
    selector = staticmethod(selectors.model_list)
    output_serializer = s.LanguageModelOut
    create_input = s.LanguageModelIn
    update_input = s.LanguageModelIn
    filterset_class = filters.LanguageModelFilter
    ordering_fields = ("name", "parameter_count_b", "max_context_tokens", "created_at")

    def create_object(self, data: dict[str, Any]) -> Model:
        return services.model_create(actor=self.request.user, **data)

    def update_object(self, obj: LanguageModel, data: Mapping[str, Any]) -> Model:
        return services.model_update(actor=self.request.user, model=obj, data=data)

    def delete_object(self, obj: LanguageModel) -> None:
        services.model_delete(actor=self.request.user, model=obj)


@crud_schema(out=s.AdapterOut, create=s.AdapterIn, update=s.AdapterIn)
class AdapterViewSet(ServiceViewSet):
    """LoRA adapters of base models."""

    tenant_viewer_readable = True
    queryset = LoraAdapter.objects.none()
    selector = staticmethod(selectors.adapter_list)
    output_serializer = s.AdapterOut
    create_input = s.AdapterIn
    update_input = s.AdapterIn
    filterset_class = filters.AdapterFilter
    ordering_fields = ("name", "rank", "created_at")

    def create_object(self, data: dict[str, Any]) -> Model:
        return services.adapter_create(actor=self.request.user, **data)

    def update_object(self, obj: LoraAdapter, data: Mapping[str, Any]) -> Model:
        return services.adapter_update(actor=self.request.user, adapter=obj, data=data)

    def delete_object(self, obj: LoraAdapter) -> None:
        services.adapter_delete(actor=self.request.user, adapter=obj)


# --- the fleet: staff only -----------------------------------------------------------------


@crud_schema(out=s.PoolOut, create=s.PoolCreateIn, update=s.PoolUpdateIn)
class PoolViewSet(ServiceViewSet):
    """GPU pools with their capacity (total, claimed by deployments, free)."""

    queryset = GPUPool.objects.none()
    selector = staticmethod(selectors.pool_list)
    output_serializer = s.PoolOut
    create_input = s.PoolCreateIn
    update_input = s.PoolUpdateIn
    filterset_class = filters.PoolFilter
    ordering_fields = ("name", "price_per_gpu_hour", "free_gpus", "node_count", "created_at")

    def create_object(self, data: dict[str, Any]) -> Model:
        return services.pool_create(actor=self.request.user, **data)

    def update_object(self, obj: GPUPool, data: Mapping[str, Any]) -> Model:
        return services.pool_update(actor=self.request.user, pool=obj, data=data)

    def delete_object(self, obj: GPUPool) -> None:
        services.pool_delete(actor=self.request.user, pool=obj)

    @extend_schema(request=None, responses={200: s.PoolOut})
    @action(detail=True, methods=["post"])
    def cordon(self, request: Request, pk: str | None = None) -> Response:
        """No new deployments or replicas on this pool; running ones keep serving."""
        return self.respond(services.pool_cordon(actor=request.user, pool=self.get_object()))

    @extend_schema(request=None, responses={200: s.PoolOut})
    @action(detail=True, methods=["post"])
    def uncordon(self, request: Request, pk: str | None = None) -> Response:
        """Let the pool take new deployments and replicas again."""
        return self.respond(services.pool_uncordon(actor=request.user, pool=self.get_object()))


@crud_schema(out=s.DeploymentOut, create=s.DeploymentCreateIn, update=s.DeploymentUpdateIn)
class DeploymentViewSet(ServiceViewSet):
    """Placements of models on pools; every write is checked against the pool (fit.py)."""

    queryset = Deployment.objects.none()
    selector = staticmethod(selectors.deployment_list)
    output_serializer = s.DeploymentOut
    create_input = s.DeploymentCreateIn
    update_input = s.DeploymentUpdateIn
    filterset_class = filters.DeploymentFilter
    ordering_fields = ("desired_replicas", "tensor_parallel_size", "created_at")

    def create_object(self, data: dict[str, Any]) -> Model:
        return services.deployment_create(actor=self.request.user, **data)

    def update_object(self, obj: Deployment, data: Mapping[str, Any]) -> Model:
        return services.deployment_update(actor=self.request.user, deployment=obj, data=data)

    def delete_object(self, obj: Deployment) -> None:
        services.deployment_delete(actor=self.request.user, deployment=obj)


@crud_schema(out=s.InstanceOut, create=s.InstanceCreateIn, update=s.InstanceUpdateIn)
class InstanceViewSet(ServiceViewSet):
    """Engine replicas; their state moves only along the lifecycle (lifecycle.py)."""

    queryset = Instance.objects.none()
    selector = staticmethod(selectors.instance_list)
    output_serializer = s.InstanceOut
    create_input = s.InstanceCreateIn
    update_input = s.InstanceUpdateIn
    filterset_class = filters.InstanceFilter
    ordering_fields = ("name", "state", "state_changed_at", "last_heartbeat_at", "created_at")

    def create_object(self, data: dict[str, Any]) -> Model:
        return services.instance_create(actor=self.request.user, **data)

    def update_object(self, obj: Instance, data: Mapping[str, Any]) -> Model:
        return services.instance_update(actor=self.request.user, instance=obj, data=data)

    def delete_object(self, obj: Instance) -> None:
        services.instance_delete(actor=self.request.user, instance=obj)

    @extend_schema(request=None, responses={200: s.InstanceOut})
    @action(detail=True, methods=["post"])
    def drain(self, request: Request, pk: str | None = None) -> Response:
        """Stop routing new requests to this ready instance."""
        return self.respond(services.instance_drain(actor=request.user, instance=self.get_object()))

    @extend_schema(request=None, responses={200: s.InstanceOut})
    @action(detail=True, methods=["post"])
    def undrain(self, request: Request, pk: str | None = None) -> Response:
        """Route new requests to this draining instance again."""
        return self.respond(
            services.instance_undrain(actor=request.user, instance=self.get_object())
        )

    @extend_schema(request=s.InstanceTransitionIn, responses={200: s.InstanceOut})
    @action(detail=True, methods=["post"])
    def transition(self, request: Request, pk: str | None = None) -> Response:
        """Move the instance along a legal lifecycle transition (409 lists the legal ones)."""
        instance = self.get_object()
        ser = s.InstanceTransitionIn(data=request.data)
        ser.is_valid(raise_exception=True)
        return self.respond(
            services.instance_transition(
                actor=request.user, instance=instance, state=ser.validated_data["state"]
            )
        )


@crud_schema(out=s.EdgeOut, create=s.EdgeCreateIn, update=s.EdgeUpdateIn)
class EdgeViewSet(ServiceViewSet):
    """Edge routers registered per region."""

    queryset = Edge.objects.none()
    selector = staticmethod(selectors.edge_list)
    output_serializer = s.EdgeOut
    create_input = s.EdgeCreateIn
    update_input = s.EdgeUpdateIn
    filterset_class = filters.EdgeFilter
    ordering_fields = ("name", "last_heartbeat_at", "applied_table_version", "created_at")

    def create_object(self, data: dict[str, Any]) -> Model:
        return services.edge_register(actor=self.request.user, **data)

    def update_object(self, obj: Edge, data: Mapping[str, Any]) -> Model:
        return services.edge_update(actor=self.request.user, edge=obj, data=data)

    def delete_object(self, obj: Edge) -> None:
        services.edge_delete(actor=self.request.user, edge=obj)
