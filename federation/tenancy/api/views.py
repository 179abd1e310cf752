"""Tenancy API v1: tenants, API keys, users, the caller (``me``) and token login.

Views only parse input, call one service or selector, and render output.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from django.contrib.auth import authenticate, logout
from django.contrib.auth.models import User
from django.db.models import Model, QuerySet
from django.utils import timezone
from drf_spectacular.utils import OpenApiResponse, extend_schema
from rest_framework import status
from rest_framework.decorators import action
from rest_framework.exceptions import ValidationError
from rest_framework.permissions import AllowAny, BasePermission, IsAuthenticated
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.throttling import BaseThrottle

from federation.api.permissions import IsAdmin
from federation.api.schema import crud_schema
from federation.api.throttles import LoginThrottle
from federation.api.views import EndpointView, ServiceViewSet
from federation.core.roles import role_of
from federation.tenancy import selectors, services
from federation.tenancy.api import serializers as s
from federation.tenancy.filters import ApiKeyFilter, TenantFilter, UserFilter
from federation.tenancy.models import ApiKey, AuthToken, Tenant

#: Tenancy resources are changed with PATCH; they take no PUT.
_PATCH_ONLY = ["get", "post", "patch", "delete", "head", "options"]


@crud_schema(out=s.TenantOutput, create=s.TenantCreateInput, update=s.TenantUpdateInput)
class TenantViewSet(ServiceViewSet):
    """Tenants and their residency policy, rate limits and budget."""

    tenant_viewer_readable = True
    lookup_field = "slug"
    http_method_names = _PATCH_ONLY
    queryset = Tenant.objects.none()
    output_serializer = s.TenantOutput
    create_input = s.TenantCreateInput
    update_input = s.TenantUpdateInput
    filterset_class = TenantFilter
    ordering_fields = ["slug", "name", "created_at"]

    def get_queryset(self) -> QuerySet[Tenant]:
        return selectors.tenant_list(user=self.request.user)

    def get_serializer_context(self) -> dict[str, Any]:
        return {**super().get_serializer_context(), "region_refs": selectors.region_refs()}

    def create_object(self, data: dict[str, Any]) -> Model:
        return services.tenant_create(actor=self.request.user, **data)

    def update_object(self, obj: Tenant, data: Mapping[str, Any]) -> Model:
        return services.tenant_update(actor=self.request.user, tenant=obj, data=data)

    def delete_object(self, obj: Tenant) -> None:
        services.tenant_delete(actor=self.request.user, tenant=obj)

    @extend_schema(request=None, responses={200: s.TenantOutput})
    @action(detail=True, methods=["post"])
    def deactivate(self, request: Request, slug: str) -> Response:
        """Stop serving the tenant; its keys, members and history stay."""
        return self.respond(
            services.tenant_deactivate(actor=request.user, tenant=self.get_object())
        )

    @extend_schema(request=None, responses={200: s.TenantOutput})
    @action(detail=True, methods=["post"])
    def activate(self, request: Request, slug: str) -> Response:
        return self.respond(services.tenant_activate(actor=request.user, tenant=self.get_object()))


@crud_schema(
    out=s.ApiKeyOutput,
    create=s.ApiKeyCreateInput,
    update=s.ApiKeyUpdateInput,
    created=s.ApiKeyIssuedOutput,
)
class ApiKeyViewSet(ServiceViewSet):
    """Inference API keys. The plaintext key appears only in the create and rotate responses."""

    tenant_viewer_readable = True
    http_method_names = _PATCH_ONLY
    queryset = ApiKey.objects.none()
    output_serializer = s.ApiKeyOutput
    create_input = s.ApiKeyCreateInput
    update_input = s.ApiKeyUpdateInput
    filterset_class = ApiKeyFilter
    ordering_fields = ["id", "name", "prefix", "created_at", "expires_at"]

    def get_queryset(self) -> QuerySet[ApiKey]:
        return selectors.api_key_list(user=self.request.user)

    def get_serializer_context(self) -> dict[str, Any]:
        return {**super().get_serializer_context(), "now": timezone.now()}

    def _issued(self, issued: services.IssuedKey, code: int) -> Response:
        context = {**self.get_serializer_context(), "plaintext_key": issued.plaintext}
        return Response(s.ApiKeyIssuedOutput(issued.api_key, context=context).data, code)

    def create(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        data = s.ApiKeyCreateInput(data=request.data)
        data.is_valid(raise_exception=True)
        issued = services.api_key_create(actor=request.user, **data.validated_data)
        return self._issued(issued, status.HTTP_201_CREATED)

    def update_object(self, obj: ApiKey, data: Mapping[str, Any]) -> Model:
        return services.api_key_update(actor=self.request.user, api_key=obj, data=data)

    def delete_object(self, obj: ApiKey) -> None:
        services.api_key_delete(actor=self.request.user, api_key=obj)

    @extend_schema(request=None, responses={200: s.ApiKeyOutput})
    @action(detail=True, methods=["post"])
    def revoke(self, request: Request, pk: str) -> Response:
        """Revoke the key for good, including a secret still in rotation grace."""
        return self.respond(services.api_key_revoke(actor=request.user, api_key=self.get_object()))

    @extend_schema(request=s.ApiKeyRotateInput, responses={200: s.ApiKeyIssuedOutput})
    @action(detail=True, methods=["post"])
    def rotate(self, request: Request, pk: str) -> Response:
        """Issue a new secret; the old one stops working now or after ``grace_seconds``."""
        api_key = self.get_object()
        data = s.ApiKeyRotateInput(data=request.data)
        data.is_valid(raise_exception=True)
        issued = services.api_key_rotate(
            actor=request.user, api_key=api_key, grace_seconds=data.validated_data["grace_seconds"]
        )
        return self._issued(issued, status.HTTP_200_OK)


@crud_schema(out=s.UserOutput, create=s.UserCreateInput, update=s.UserUpdateInput)
class UserViewSet(ServiceViewSet):
    """People who use the console and the API, with their role (admins only)."""

    permission_classes = [IsAdmin]
    http_method_names = _PATCH_ONLY
    queryset = User.objects.none()
    selector = staticmethod(selectors.user_list)
    output_serializer = s.UserOutput
    create_input = s.UserCreateInput
    update_input = s.UserUpdateInput
    filterset_class = UserFilter
    ordering_fields = ["id", "username", "date_joined"]

    def create_object(self, data: dict[str, Any]) -> Model:
        return services.user_create(actor=self.request.user, **data)

    def update_object(self, obj: User, data: Mapping[str, Any]) -> Model:
        return services.user_update(actor=self.request.user, user=obj, data=data)

    def delete_object(self, obj: User) -> None:
        services.user_delete(actor=self.request.user, user=obj)


class MeView(EndpointView):
    """Who the caller is: username, role and (for tenant viewers) tenant."""

    permission_classes = [IsAuthenticated]

    @extend_schema(responses={200: s.MeOutput})
    def get(self, request: Request) -> Response:
        user = request.user
        return Response(
            s.MeOutput(
                {
                    "username": user.get_username(),
                    "email": getattr(user, "email", ""),
                    "role": role_of(user),
                    "tenant": s.tenant_slug_of(user),
                }
            ).data
        )


class AuthTokenView(EndpointView):
    """Log in for an API token (POST), or log out (DELETE): the token the request carries is
    revoked, or the session login ends."""

    def get_throttles(self) -> list[BaseThrottle]:
        return [LoginThrottle()] if self.request.method == "POST" else []

    def get_permissions(self) -> list[BasePermission]:
        if self.request.method == "POST":
            return [AllowAny()]
        return [IsAuthenticated()]

    @extend_schema(
        request=s.TokenCreateInput,
        responses={
            200: s.TokenOutput,
            401: OpenApiResponse(description="An Authorization header with an invalid token."),
            429: OpenApiResponse(description="Too many attempts; see Retry-After."),
        },
    )
    def post(self, request: Request) -> Response:
        data = self.validated(s.TokenCreateInput, request.data)
        user = authenticate(request._request, username=data["username"], password=data["password"])
        if user is None:
            raise ValidationError(
                {"non_field_errors": ["Unable to log in with these credentials."]},
                code="authorization",
            )
        assert isinstance(user, User)
        issued = services.auth_token_issue(user=user)
        out = {"token": issued.plaintext, "expires_at": issued.token.expires_at}
        return Response(s.TokenOutput(out).data)

    @extend_schema(request=None, responses={204: OpenApiResponse(description="Logged out.")})
    def delete(self, request: Request) -> Response:
        if isinstance(request.auth, AuthToken):
            services.auth_token_revoke(token=request.auth)
        else:  # authenticated by session: end it
            logout(request._request)
        return Response(status=status.HTTP_204_NO_CONTENT)
