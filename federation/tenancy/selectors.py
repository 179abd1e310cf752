"""Reads for tenancy. Querysets are scoped by the caller's role here, once, so that every view
built on them hides other tenants' objects: lists leave them out and details answer 404."""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal
from typing import Any, cast

from django.contrib.auth.models import User
from django.db.models import Q, QuerySet
from django.utils import timezone

from federation.core.roles import TENANT_VIEWER, is_staff_role, role_of, tenant_id_of
from federation.inventory.models import Edge, Region
from federation.tenancy import keys, residency
from federation.tenancy.models import ApiKey, ApiKeyPrefix, AuthToken, Tenant


def _visible(qs: QuerySet[Any], user: Any, tenant_field: str) -> QuerySet[Any]:
    if is_staff_role(user):
        return qs
    if role_of(user) == TENANT_VIEWER:
        return qs.filter(**{tenant_field: tenant_id_of(user)})
    return qs.none()


def tenant_list(*, user: Any) -> QuerySet[Tenant]:
    """Tenants the user may see: all for staff, its own for a tenant viewer, none otherwise."""
    qs = Tenant.objects.prefetch_related("allowed_regions")
    return _visible(qs, user, "pk")


def api_key_list(*, user: Any) -> QuerySet[ApiKey]:
    qs = ApiKey.objects.select_related("tenant", "created_by")
    return _visible(qs, user, "tenant_id")


def auth_token_by_key(plaintext: str) -> AuthToken | None:
    """The token this is (expired or not), with its user; None for anything else. Only the
    hash is looked up."""
    if not keys.is_well_formed_token(plaintext):
        return None
    return (
        AuthToken.objects.select_related("user").filter(key_hash=keys.hash_key(plaintext)).first()
    )


def edge_by_credential(plaintext: str) -> Edge | None:
    """The edge whose credential this is (``keys.EDGE_CREDENTIAL_PREFIX``), or None. Only
    hashes are stored and compared."""
    if not plaintext.startswith(keys.EDGE_CREDENTIAL_PREFIX) or "\x00" in plaintext:
        return None
    digest = keys.hash_key(plaintext)
    edge = Edge.objects.select_related("region").filter(credential_hash=digest).first()
    if edge is None or not hmac.compare_digest(edge.credential_hash, digest):
        return None
    return edge


def user_list() -> QuerySet[User]:
    return User.objects.select_related("membership__tenant").order_by("username")


def region_refs() -> list[residency.RegionRef]:
    """Every region as the residency module sees it (one query)."""
    return [
        residency.RegionRef(code=code, jurisdiction=jurisdiction)
        for code, jurisdiction in Region.objects.order_by("code").values_list(
            "code", "jurisdiction"
        )
    ]


def tenant_permitted_regions(
    tenant: Tenant, regions: list[residency.RegionRef] | None = None
) -> list[str]:
    """Codes of the regions that may serve the tenant under its residency policy."""
    policy = residency.ResidencyPolicy.of(
        tenant.allowed_jurisdictions, (r.code for r in tenant.allowed_regions.all())
    )
    return [
        r.code
        for r in residency.allowed_regions(policy, region_refs() if regions is None else regions)
    ]


def api_key_authenticate(*, key: str, now: datetime | None = None) -> ApiKey | None:
    """The key a plaintext authenticates as, or None: malformed, unknown, revoked, expired,
    past its rotation grace, or of an inactive tenant. The routing table the edge uses is
    compiled from the same rules."""
    if not keys.is_well_formed(key):
        return None
    now = now or timezone.now()
    digest = keys.hash_key(key)
    api_key = (
        ApiKey.objects.select_related("tenant")
        .filter(Q(key_hash=digest) | Q(previous_key_hash=digest, previous_key_valid_until__gt=now))
        .first()
    )
    if api_key is None or api_key.status_at(now) != "active" or not api_key.tenant.is_active:
        return None
    return api_key


@dataclass(frozen=True, slots=True)
class KeyTableEntry:
    """One hash the edge accepts: what the routing-table compiler publishes per key."""

    key_hash: str
    api_key_id: int
    tenant_id: int
    scopes: tuple[str, ...]
    valid_until: datetime | None  # the edge stops accepting the hash then; None = no end


def api_key_table_entries(*, now: datetime | None = None) -> list[KeyTableEntry]:
    """Every hash usable at ``now``: the current secret of each active key of an active
    tenant, plus a rotated-out secret while its grace lasts. Same rules as
    ``api_key_authenticate``, so the edge and the control plane agree."""
    now = now or timezone.now()
    entries: list[KeyTableEntry] = []
    # Plain rows, not model instances: every compile reads every key.
    usable = (
        ApiKey.objects.filter(tenant__is_active=True, revoked_at__isnull=True)
        .filter(Q(expires_at__isnull=True) | Q(expires_at__gt=now))
        .order_by("id")
        .values_list(
            "pk",
            "tenant_id",
            "key_hash",
            "scopes",
            "expires_at",
            "previous_key_hash",
            "previous_key_valid_until",
        )
    )
    for pk, tenant_id, key_hash, scope_list, expires, previous, grace in usable:
        scopes = tuple(scope_list)
        entries.append(KeyTableEntry(key_hash, pk, tenant_id, scopes, expires))
        if previous and grace is not None and grace > now:
            until = min(grace, expires) if expires else grace
            entries.append(KeyTableEntry(previous, pk, tenant_id, scopes, until))
    return entries


@dataclass(frozen=True, slots=True)
class KeyBudgetEntry:
    """A usable key's own monthly budget and the public prefixes it is known by."""

    tenant: str
    budget_usd: Decimal
    #: The prefixes its usable secrets are sent with: the current one, then one still in
    #: rotation grace.
    live: tuple[str, ...]
    #: Every prefix it has had, ``live`` included (its usage is recorded under them).
    prefixes: tuple[str, ...]


def api_key_budgets(*, now: datetime) -> list[KeyBudgetEntry]:
    """The budgets of the keys of active tenants usable at ``now`` that have one (two
    queries). A key's identity across rotations is the key itself: its prefixes are kept in
    ``ApiKeyPrefix``, so its spend this month is what was counted under any of them."""
    rows = list(
        ApiKey.objects.filter(
            tenant__is_active=True,
            revoked_at__isnull=True,
            monthly_budget_usd__isnull=False,
        )
        .filter(Q(expires_at__isnull=True) | Q(expires_at__gt=now))
        .order_by("id")
        .values_list(
            "pk",
            "tenant__slug",
            "monthly_budget_usd",
            "prefix",
            "previous_prefix",
            "previous_key_valid_until",
        )
    )
    known: dict[int, list[str]] = {}
    for key_id, prefix in ApiKeyPrefix.objects.filter(
        api_key_id__in=[row[0] for row in rows]
    ).values_list("api_key_id", "prefix"):
        known.setdefault(key_id, []).append(prefix)
    entries = []
    for pk, tenant, budget, prefix, previous, grace in rows:
        live = (prefix, previous) if previous and grace is not None and grace > now else (prefix,)
        prefixes = tuple(sorted({*live, *known.get(pk, ())}))
        # Filtered on a budget above: never None.
        entries.append(KeyBudgetEntry(tenant, cast(Decimal, budget), live, prefixes))
    return entries
