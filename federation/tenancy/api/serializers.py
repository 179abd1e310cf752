"""Input and output shapes of the tenancy API (``federation.api.serializers``)."""

from __future__ import annotations

from typing import Any

from django.contrib.auth.models import User
from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from federation.api.fields import (
    MoneyField,
    SlugLookupField,
    StrictBooleanField,
    StrictIntegerField,
    UTCDateTimeField,
)
from federation.api.serializers import InputSerializer, OutputModelSerializer
from federation.core.roles import role_of
from federation.inventory.models import Jurisdiction, Region, slug_validator
from federation.tenancy import selectors
from federation.tenancy.models import ApiKey, Membership, Tenant
from federation.tenancy.services import MAX_ROTATION_GRACE_SECONDS

MAX_INT32 = 2**31 - 1


def _region_field(**kwargs: Any) -> SlugLookupField:
    return SlugLookupField(
        many=True,
        slug_field="code",
        queryset=Region.objects.all(),
        help_text="Region codes; empty = every region of the allowed jurisdictions.",
        **kwargs,
    )


def _jurisdictions_field(**kwargs: Any) -> serializers.ListField:
    return serializers.ListField(
        child=serializers.ChoiceField(choices=Jurisdiction.choices),
        max_length=len(Jurisdiction.values),
        help_text="Jurisdiction codes, e.g. ['EU']; empty = any.",
        **kwargs,
    )


def _rate_field() -> serializers.IntegerField:
    return StrictIntegerField(
        min_value=1,
        max_value=MAX_INT32,
        allow_null=True,
        required=False,
        help_text="null = unlimited.",
    )


class TenantCreateInput(InputSerializer):
    slug = serializers.RegexField(
        regex=slug_validator.regex,
        max_length=63,
        error_messages={"invalid": slug_validator.message},
        help_text="Lowercase letters, digits and inner hyphens; fixed once created.",
    )
    name = serializers.CharField(max_length=200)
    allowed_jurisdictions = _jurisdictions_field(required=False)
    allowed_regions = _region_field(required=False)
    requests_per_minute = _rate_field()
    tokens_per_minute = _rate_field()
    monthly_budget_usd = MoneyField(allow_null=True, required=False)
    isolate_kv_cache = StrictBooleanField(
        required=False,
        default=False,
        help_text="Engines never share this tenant's cached prompt prefixes with other tenants.",
    )
    is_active = StrictBooleanField(required=False, default=True)


class TenantUpdateInput(InputSerializer):
    name = serializers.CharField(max_length=200, required=False)
    allowed_jurisdictions = _jurisdictions_field(required=False)
    allowed_regions = _region_field(required=False)
    requests_per_minute = _rate_field()
    tokens_per_minute = _rate_field()
    monthly_budget_usd = MoneyField(allow_null=True, required=False)
    isolate_kv_cache = StrictBooleanField(required=False)


class TenantOutput(OutputModelSerializer):
    allowed_regions: serializers.SlugRelatedField[Region] = serializers.SlugRelatedField(
        many=True, read_only=True, slug_field="code"
    )
    permitted_regions = serializers.SerializerMethodField(
        help_text="Regions that may serve this tenant under its residency policy."
    )

    class Meta:
        model = Tenant
        fields = [
            "slug",
            "name",
            "allowed_jurisdictions",
            "allowed_regions",
            "permitted_regions",
            "requests_per_minute",
            "tokens_per_minute",
            "monthly_budget_usd",
            "isolate_kv_cache",
            "is_active",
            "created_at",
            "updated_at",
        ]

    @extend_schema_field(serializers.ListField(child=serializers.CharField()))
    def get_permitted_regions(self, tenant: Tenant) -> list[str]:
        return selectors.tenant_permitted_regions(tenant, self.context.get("region_refs"))


def _scopes_field(**kwargs: Any) -> serializers.ListField:
    return serializers.ListField(
        child=serializers.ChoiceField(choices=ApiKey.Scope.choices),
        min_length=1,
        max_length=len(ApiKey.Scope.values),
        required=False,
        **kwargs,
    )


class ApiKeyCreateInput(InputSerializer):
    tenant = SlugLookupField(slug_field="slug", queryset=Tenant.objects.all())
    name = serializers.CharField(max_length=100)
    scopes = _scopes_field(help_text="Default: ['inference'].")
    expires_at = UTCDateTimeField(
        required=False, allow_null=True, help_text="Must be in the future; null = never."
    )
    monthly_budget_usd = MoneyField(
        allow_null=True,
        required=False,
        help_text="This key's own monthly budget (the tenant's still applies); null = none.",
    )


class ApiKeyUpdateInput(InputSerializer):
    name = serializers.CharField(max_length=100, required=False)
    scopes = _scopes_field()
    expires_at = UTCDateTimeField(required=False, allow_null=True)
    monthly_budget_usd = MoneyField(allow_null=True, required=False)


class ApiKeyRotateInput(InputSerializer):
    grace_seconds = StrictIntegerField(
        min_value=0,
        max_value=MAX_ROTATION_GRACE_SECONDS,
        required=False,
        default=0,
        help_text="How long the old secret keeps working; 0 = it stops now.",
    )


class ApiKeyOutput(OutputModelSerializer):
    tenant: serializers.SlugRelatedField[Tenant] = serializers.SlugRelatedField(
        read_only=True, slug_field="slug"
    )
    status = serializers.SerializerMethodField()
    created_by: serializers.SlugRelatedField[User] = serializers.SlugRelatedField(
        read_only=True, slug_field="username", allow_null=True
    )
    previous_secret_valid_until = serializers.DateTimeField(
        source="previous_key_valid_until",
        read_only=True,
        allow_null=True,
        help_text="Until when the secret replaced by the last rotation still works.",
    )

    class Meta:
        model = ApiKey
        fields = [
            "id",
            "tenant",
            "name",
            "prefix",
            "scopes",
            "status",
            "expires_at",
            "revoked_at",
            "last_used_at",
            "previous_secret_valid_until",
            "monthly_budget_usd",
            "created_by",
            "created_at",
            "updated_at",
        ]

    @extend_schema_field(serializers.ChoiceField(choices=["active", "revoked", "expired"]))
    def get_status(self, api_key: ApiKey) -> str:
        return api_key.status_at(self.context["now"])


class ApiKeyIssuedOutput(ApiKeyOutput):
    key = serializers.SerializerMethodField(
        help_text="The full key. Shown only in this response: store it now."
    )

    class Meta(ApiKeyOutput.Meta):
        fields = [*ApiKeyOutput.Meta.fields, "key"]

    def get_key(self, api_key: ApiKey) -> str:
        return str(self.context["plaintext_key"])


def _password_field(**kwargs: Any) -> serializers.CharField:
    return serializers.CharField(
        write_only=True,
        min_length=8,
        max_length=128,
        trim_whitespace=False,
        style={"input_type": "password"},
        **kwargs,
    )


class UserCreateInput(InputSerializer):
    username = serializers.RegexField(
        regex=r"^[\w.@+-]+\Z",
        max_length=150,
        error_messages={"invalid": "Use letters, digits and @ . + - _ only."},
    )
    email = serializers.EmailField(required=False, allow_blank=True, default="")
    password = _password_field()
    role = serializers.ChoiceField(choices=Membership.Role.choices)
    tenant = SlugLookupField(
        slug_field="slug",
        queryset=Tenant.objects.all(),
        required=False,
        allow_null=True,
        help_text="Required for tenant viewers, refused for other roles.",
    )


class UserUpdateInput(InputSerializer):
    email = serializers.EmailField(required=False, allow_blank=True)
    password = _password_field(required=False)
    role = serializers.ChoiceField(choices=Membership.Role.choices, required=False)
    tenant = SlugLookupField(
        slug_field="slug", queryset=Tenant.objects.all(), required=False, allow_null=True
    )
    is_active = StrictBooleanField(required=False)


def tenant_slug_of(user: Any) -> str | None:
    """The slug of the tenant the user belongs to (tenant viewers), else None."""
    membership = getattr(user, "membership", None)
    tenant = membership.tenant if membership is not None else None
    return tenant.slug if tenant is not None else None


class UserOutput(OutputModelSerializer):
    email = serializers.CharField(help_text="May be empty.")
    role = serializers.SerializerMethodField()
    tenant = serializers.SerializerMethodField()

    class Meta:
        model = User
        fields = [
            "id",
            "username",
            "email",
            "role",
            "tenant",
            "is_active",
            "date_joined",
            "last_login",
        ]

    @extend_schema_field(serializers.ChoiceField(choices=Membership.Role.choices, allow_null=True))
    def get_role(self, user: User) -> str | None:
        return role_of(user)

    def get_tenant(self, user: User) -> str | None:
        return tenant_slug_of(user)


class MeOutput(serializers.Serializer):
    username = serializers.CharField()
    email = serializers.CharField()
    role = serializers.ChoiceField(choices=Membership.Role.choices, allow_null=True)
    tenant = serializers.CharField(allow_null=True, help_text="Slug; set for tenant viewers.")


class TokenCreateInput(InputSerializer):
    username = serializers.CharField(max_length=150)
    password = serializers.CharField(
        max_length=128, trim_whitespace=False, style={"input_type": "password"}
    )


class TokenOutput(serializers.Serializer):
    token = serializers.CharField(
        help_text="Send as 'Authorization: Token <token>'. Shown this once; only its hash is "
        "stored."
    )
    expires_at = serializers.DateTimeField(help_text="Log in again after this.")
