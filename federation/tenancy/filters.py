"""Query filters for the tenancy API (django-filter)."""

from __future__ import annotations

from typing import Any

import django_filters
from django.contrib.auth.models import User
from django.db import connection
from django.db.models import QuerySet

from federation.api.filters import StrictBooleanFilter, StrictFilterSet
from federation.inventory.models import Jurisdiction
from federation.tenancy.models import ApiKey, Membership, Tenant


class TenantFilter(StrictFilterSet):
    slug = django_filters.CharFilter()
    is_active = StrictBooleanFilter()
    jurisdiction = django_filters.ChoiceFilter(
        choices=Jurisdiction.choices,
        method="filter_jurisdiction",
        label="Tenants whose allowed jurisdictions list this code.",
    )

    class Meta:
        model = Tenant
        fields = ["slug", "is_active", "jurisdiction"]

    def filter_jurisdiction(self, qs: QuerySet[Tenant], name: str, value: str) -> QuerySet[Tenant]:
        if connection.features.supports_json_field_contains:
            return qs.filter(allowed_jurisdictions__contains=[value])
        # SQLite (the demo database) has no JSON containment; codes are quoted in the
        # stored text and no code is a substring of another once quoted.
        return qs.filter(allowed_jurisdictions__icontains=f'"{value}"')


class ApiKeyFilter(StrictFilterSet):
    # A plain slug match, not a choice of tenants: naming a tenant the caller may not see
    # answers exactly like naming one that does not exist (an empty list, never a 400).
    tenant = django_filters.CharFilter(field_name="tenant__slug", label="Tenant slug.")
    prefix = django_filters.CharFilter()
    revoked = StrictBooleanFilter(
        method="filter_revoked", label="true: revoked keys only; false: unrevoked keys only."
    )

    class Meta:
        model = ApiKey
        fields = ["tenant", "prefix", "revoked"]

    def filter_revoked(self, qs: QuerySet[ApiKey], name: str, value: Any) -> QuerySet[ApiKey]:
        return qs.filter(revoked_at__isnull=not value)


class UserFilter(StrictFilterSet):
    username = django_filters.CharFilter()
    is_active = StrictBooleanFilter()
    role = django_filters.ChoiceFilter(
        field_name="membership__role", choices=Membership.Role.choices
    )
    tenant = django_filters.CharFilter(field_name="membership__tenant__slug", label="Tenant slug.")

    class Meta:
        model = User
        fields = ["username", "is_active", "role", "tenant"]
