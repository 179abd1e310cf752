"""The views every domain's API is built from: load through a selector, validate the shape
with an input serializer, call one service, render with the output serializer. Writes never
touch ``save()`` here.

* ``ReadViewSet`` and ``ServiceViewSet``: a resource's list, detail and CRUD;
* ``EndpointView``: everything else, one endpoint each (an action on one object, a report, an
  edge's endpoint, who the caller is).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, ClassVar

from django.db.models import Model, QuerySet
from rest_framework import mixins, status, viewsets
from rest_framework.exceptions import NotFound
from rest_framework.generics import get_object_or_404
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.serializers import BaseSerializer
from rest_framework.views import APIView


def nul_free_or_404(*values: str) -> None:
    """PostgreSQL cannot compare text holding NUL: a lookup by such a value matches nothing,
    so it is a 404 before it reaches the database (where it would be a 500)."""
    if any("\x00" in value for value in values):
        raise NotFound()


class ReadViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet):
    """List and retrieve through a selector and the output serializer."""

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
        nul_free_or_404(str(self.kwargs.get(self.lookup_url_kwarg or self.lookup_field, "")))
        return super().get_object()

    def respond(self, obj: Model, code: int = status.HTTP_200_OK) -> Response:
        """Render ``obj`` re-read through the selector (fresh annotations and relations)."""
        fresh = self.get_queryset().get(pk=obj.pk)
        context = self.get_serializer_context()
        return Response(self.output_serializer(fresh, context=context).data, status=code)


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


class EndpointView(APIView):
    """The base of every API view that is not a viewset: an action on one object (rotate a
    credential, replay a dead letter, plan or apply a placement), a report (JSON or CSV), an
    edge's endpoint (its long-polled table with an ETag, its heartbeats, its usage) or who the
    caller is.

    Like the viewsets it takes the project's defaults from ``REST_FRAMEWORK``, in one place for
    both: the error shape (``federation.api.errors``), the OpenAPI ``AutoSchema`` (every 4xx
    documented), and the authentication, permission, parser and throttle classes. A view sets
    only what differs (``permission_classes = [IsStaff]`` with its ``staff_only``, an edge's
    authentication, a login throttle); its handlers check their input with ``validated``, load
    with ``object_or_404`` and call one service or selector.
    """

    @staticmethod
    def validated(serializer: type[BaseSerializer], data: Any) -> dict[str, Any]:
        """``data`` checked by the input ``serializer`` (a 400 with its errors if not)."""
        checked = serializer(data=data)
        checked.is_valid(raise_exception=True)
        return dict(checked.validated_data)

    @staticmethod
    def object_or_404(queryset: QuerySet[Any] | type[Model], **lookup: Any) -> Any:
        """The one object ``lookup`` names, or a JSON 404 (also for a NUL in a text lookup,
        which PostgreSQL cannot compare)."""
        nul_free_or_404(*(v for v in lookup.values() if isinstance(v, str)))
        return get_object_or_404(queryset, **lookup)
