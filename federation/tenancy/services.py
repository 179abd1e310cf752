"""Writes for tenancy: tenants, API keys, users and their roles.

Every function validates before it saves (``ValidationError`` → 400), refuses changes that
conflict with the current state (``Conflict`` → 409), runs in one transaction and records an
audit event, so a failed call leaves nothing half-written. The helpers they share, and how a
duplicate or an unknown field is answered, are ``federation.core.services``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from decimal import Decimal
from typing import Any

from django.conf import settings
from django.contrib.auth.models import User
from django.contrib.auth.password_validation import validate_password
from django.core.exceptions import ValidationError
from django.db import transaction
from django.utils import timezone

from federation.core.audit import Actor, audit_record
from federation.core.errors import Conflict
from federation.core.roles import ADMIN, TENANT_VIEWER, role_of
from federation.core.services import (
    model_apply,
    model_lock,
    model_save,
    model_update_check,
    model_validate,
)
from federation.inventory.models import Jurisdiction, Region
from federation.tenancy import keys, residency
from federation.tenancy.models import ApiKey, ApiKeyPrefix, AuthToken, Membership, Tenant

MAX_ROTATION_GRACE_SECONDS = 24 * 3600


# --- tenants -------------------------------------------------------------------------------


def tenant_residency_errors(
    jurisdictions: Iterable[str], regions: Iterable[Region]
) -> dict[str, list[str]]:
    """Why this residency policy is impossible, by field; empty when it is valid."""
    region_list = list(regions)
    policy = residency.ResidencyPolicy.of(jurisdictions, (r.code for r in region_list))
    return residency.policy_errors(
        policy,
        known_jurisdictions=Jurisdiction.values,
        region_jurisdictions={r.code: r.jurisdiction for r in region_list},
    )


def _region_codes(regions: Iterable[Region]) -> list[str]:
    return sorted(r.code for r in regions)


@transaction.atomic
def tenant_create(
    *,
    actor: Actor,
    slug: str,
    name: str,
    allowed_jurisdictions: Iterable[str] = (),
    allowed_regions: Iterable[Region] = (),
    requests_per_minute: int | None = None,
    tokens_per_minute: int | None = None,
    monthly_budget_usd: Decimal | None = None,
    isolate_kv_cache: bool = False,
    is_active: bool = True,
) -> Tenant:
    jurisdictions = sorted(set(allowed_jurisdictions))
    regions = list(allowed_regions)
    tenant = Tenant(
        slug=slug,
        name=name,
        allowed_jurisdictions=jurisdictions,
        requests_per_minute=requests_per_minute,
        tokens_per_minute=tokens_per_minute,
        monthly_budget_usd=monthly_budget_usd,
        isolate_kv_cache=isolate_kv_cache,
        is_active=is_active,
    )
    model_validate(tenant, extra=tenant_residency_errors(jurisdictions, regions))
    model_save(tenant)
    tenant.allowed_regions.set(regions)
    audit_record(
        actor=actor,
        action="tenant.create",
        obj=tenant,
        changes={
            "slug": slug,
            "name": name,
            "allowed_jurisdictions": jurisdictions,
            "allowed_regions": _region_codes(regions),
            "requests_per_minute": requests_per_minute,
            "tokens_per_minute": tokens_per_minute,
            "monthly_budget_usd": monthly_budget_usd,
            "isolate_kv_cache": isolate_kv_cache,
            "is_active": is_active,
        },
    )
    return tenant


TENANT_UPDATABLE = frozenset(
    {
        "name",
        "allowed_jurisdictions",
        "allowed_regions",
        "requests_per_minute",
        "tokens_per_minute",
        "monthly_budget_usd",
        "isolate_kv_cache",
    }
)


@transaction.atomic
def tenant_update(*, actor: Actor, tenant: Tenant, data: Mapping[str, Any]) -> Tenant:
    """Change the fields in ``data`` (a subset of ``TENANT_UPDATABLE``); the slug is fixed
    because keys, tables and usage records refer to it."""
    model_update_check(tenant, data, updatable=TENANT_UPDATABLE)
    tenant = model_lock(tenant)
    fields = {k: v for k, v in data.items() if k != "allowed_regions"}
    if "allowed_jurisdictions" in fields:
        fields["allowed_jurisdictions"] = sorted(set(fields["allowed_jurisdictions"]))
    old_regions = list(tenant.allowed_regions.all())
    new_regions = list(data["allowed_regions"]) if "allowed_regions" in data else old_regions

    changes: dict[str, Any] = model_apply(tenant, fields, updatable=TENANT_UPDATABLE)
    if _region_codes(old_regions) != _region_codes(new_regions):
        changes["allowed_regions"] = [_region_codes(old_regions), _region_codes(new_regions)]
    model_validate(tenant, extra=tenant_residency_errors(tenant.allowed_jurisdictions, new_regions))
    if not changes:
        return tenant
    tenant.save()
    if "allowed_regions" in changes:
        tenant.allowed_regions.set(new_regions)
    audit_record(actor=actor, action="tenant.update", obj=tenant, changes=changes)
    return tenant


def _tenant_set_active(*, actor: Actor, tenant: Tenant, active: bool) -> Tenant:
    tenant = model_lock(tenant)
    if tenant.is_active == active:
        state = "active" if active else "inactive"
        raise Conflict(f"Tenant {tenant.slug} is already {state}.", code="no_change")
    tenant.is_active = active
    tenant.save(update_fields=["is_active", "updated_at"])
    audit_record(
        actor=actor,
        action="tenant.activate" if active else "tenant.deactivate",
        obj=tenant,
        changes={"is_active": [not active, active]},
    )
    return tenant


@transaction.atomic
def tenant_deactivate(*, actor: Actor, tenant: Tenant) -> Tenant:
    """Stop serving a tenant without losing its keys, members or history. The tables without
    it are published on commit by this request, not the worker (``ACTIONS_PUBLISHED_AT_ONCE``
    in ``federation.routing.services``)."""
    return _tenant_set_active(actor=actor, tenant=tenant, active=False)


@transaction.atomic
def tenant_activate(*, actor: Actor, tenant: Tenant) -> Tenant:
    return _tenant_set_active(actor=actor, tenant=tenant, active=True)


@transaction.atomic
def tenant_delete(*, actor: Actor, tenant: Tenant) -> None:
    """Delete a tenant with its keys and viewer memberships. Refused while it has usable keys,
    so a live customer is not cut off by one click; revoke them or deactivate instead."""
    tenant = model_lock(tenant)
    now = timezone.now()
    live = [k.prefix for k in tenant.api_keys.all() if k.status_at(now) == "active"]
    if live:
        raise Conflict(
            f"Tenant {tenant.slug} still has {len(live)} active API key(s) "
            f"({', '.join(sorted(live))}); revoke them or deactivate the tenant instead.",
            code="tenant_has_active_keys",
        )
    audit_record(actor=actor, action="tenant.delete", obj=tenant, changes={"slug": tenant.slug})
    tenant.delete()


# --- API keys ------------------------------------------------------------------------------


@dataclass(frozen=True)
class IssuedKey:
    """A key just created or rotated, with the only copy of its plaintext."""

    api_key: ApiKey
    plaintext: str

    def __repr__(self) -> str:
        return f"IssuedKey(api_key={self.api_key!r})"


def _scope_errors(scopes: Iterable[str]) -> list[str]:
    scope_list = list(scopes)
    if not scope_list:
        return ["Give at least one scope."]
    valid = set(ApiKey.Scope.values)
    return [
        f"unknown scope {s!r}; valid: {sorted(valid)}"
        for s in scope_list
        if not isinstance(s, str) or s not in valid
    ]


def _expiry_errors(expires_at: datetime | None, now: datetime) -> list[str]:
    if expires_at is not None and expires_at <= now:
        return ["Must be in the future."]
    return []


def _unused_key() -> keys.GeneratedKey:
    """A fresh key whose prefix no key has or had (the unique constraints remain the last
    guard): an old prefix given to another key would move spend between keys."""
    for _ in range(5):
        generated = keys.generate_key()
        taken = ApiKey.objects.filter(prefix=generated.prefix).exists()
        if not taken and not ApiKeyPrefix.objects.filter(prefix=generated.prefix).exists():
            return generated
    raise RuntimeError("could not find an unused API key prefix in 5 attempts")


@transaction.atomic
def api_key_create(
    *,
    actor: Actor,
    tenant: Tenant,
    name: str,
    scopes: Iterable[str] = (ApiKey.Scope.INFERENCE,),
    expires_at: datetime | None = None,
    monthly_budget_usd: Decimal | None = None,
) -> IssuedKey:
    scope_list = sorted(set(scopes))
    errors: dict[str, list[str]] = {}
    if scope_errors := _scope_errors(scope_list):
        errors["scopes"] = scope_errors
    if expiry_errors := _expiry_errors(expires_at, timezone.now()):
        errors["expires_at"] = expiry_errors
    generated = _unused_key()
    api_key = ApiKey(
        tenant=tenant,
        name=name,
        prefix=generated.prefix,
        key_hash=generated.key_hash,
        scopes=scope_list,
        expires_at=expires_at,
        monthly_budget_usd=monthly_budget_usd,
        created_by=actor if isinstance(actor, User) else None,
    )
    model_validate(api_key, extra=errors)
    if not tenant.is_active:
        raise Conflict(f"Tenant {tenant.slug} is inactive; activate it first.", code="inactive")
    model_save(api_key)
    ApiKeyPrefix.objects.create(api_key=api_key, prefix=api_key.prefix, created_at=timezone.now())
    audit_record(
        actor=actor,
        action="api_key.create",
        obj=api_key,
        changes={
            "tenant": tenant.slug,
            "name": name,
            "prefix": api_key.prefix,
            "scopes": scope_list,
            "expires_at": expires_at,
            "monthly_budget_usd": monthly_budget_usd,
        },
    )
    return IssuedKey(api_key=api_key, plaintext=generated.plaintext)


def _locked_usable_key(api_key: ApiKey, verb: str) -> ApiKey:
    locked = ApiKey.objects.select_for_update().select_related("tenant").get(pk=api_key.pk)
    status = locked.status_at(timezone.now())
    if status != "active":
        raise Conflict(f"API key {locked.prefix} is {status}; cannot {verb} it.", code=status)
    return locked


API_KEY_UPDATABLE = frozenset({"name", "scopes", "expires_at", "monthly_budget_usd"})


@transaction.atomic
def api_key_update(*, actor: Actor, api_key: ApiKey, data: Mapping[str, Any]) -> ApiKey:
    model_update_check(api_key, data, updatable=API_KEY_UPDATABLE)
    api_key = _locked_usable_key(api_key, "change")
    fields = dict(data)
    errors: dict[str, list[str]] = {}
    if "scopes" in fields:
        fields["scopes"] = sorted(set(fields["scopes"]))
        if scope_errors := _scope_errors(fields["scopes"]):
            errors["scopes"] = scope_errors
    if "expires_at" in fields and (
        expiry_errors := _expiry_errors(fields["expires_at"], timezone.now())
    ):
        errors["expires_at"] = expiry_errors
    changes = model_apply(api_key, fields, updatable=API_KEY_UPDATABLE)
    model_validate(api_key, extra=errors)
    if changes:
        api_key.save()
        audit_record(actor=actor, action="api_key.update", obj=api_key, changes=changes)
    return api_key


@transaction.atomic
def api_key_revoke(*, actor: Actor, api_key: ApiKey) -> ApiKey:
    """Revoke for good: the current secret and any secret still in rotation grace stop working.
    The tables without it are published on commit by this request, not the worker."""
    api_key = model_lock(api_key)
    if api_key.revoked_at is not None:
        raise Conflict(f"API key {api_key.prefix} is already revoked.", code="revoked")
    api_key.revoked_at = timezone.now()
    api_key.previous_key_valid_until = None
    api_key.save(update_fields=["revoked_at", "previous_key_valid_until", "updated_at"])
    audit_record(
        actor=actor,
        action="api_key.revoke",
        obj=api_key,
        changes={"revoked_at": api_key.revoked_at},
    )
    return api_key


@transaction.atomic
def api_key_rotate(*, actor: Actor, api_key: ApiKey, grace_seconds: int = 0) -> IssuedKey:
    """Issue a new secret (and prefix). The old secret stops working now, or after
    ``grace_seconds`` so clients can switch over without an outage. The key stays the same
    key: its budget, and this month's spend under every prefix it had, carry over
    (``ApiKeyPrefix``). The new tables are published on commit by this request, not the
    worker."""
    if not 0 <= grace_seconds <= MAX_ROTATION_GRACE_SECONDS:
        raise ValidationError(
            {"grace_seconds": [f"Must be between 0 and {MAX_ROTATION_GRACE_SECONDS}."]}
        )
    api_key = _locked_usable_key(api_key, "rotate")
    now = timezone.now()
    generated = _unused_key()
    old_prefix = api_key.prefix
    if grace_seconds:
        api_key.previous_key_hash = api_key.key_hash
        api_key.previous_key_valid_until = now + timedelta(seconds=grace_seconds)
        api_key.previous_prefix = old_prefix
    else:
        api_key.previous_key_hash = ""
        api_key.previous_key_valid_until = None
        api_key.previous_prefix = ""
    api_key.prefix = generated.prefix
    api_key.key_hash = generated.key_hash
    api_key.save()
    ApiKeyPrefix.objects.create(api_key=api_key, prefix=api_key.prefix, created_at=now)
    audit_record(
        actor=actor,
        action="api_key.rotate",
        obj=api_key,
        changes={
            "prefix": [old_prefix, api_key.prefix],
            "old_secret_valid_until": api_key.previous_key_valid_until or now,
        },
    )
    return IssuedKey(api_key=api_key, plaintext=generated.plaintext)


@transaction.atomic
def api_key_delete(*, actor: Actor, api_key: ApiKey) -> None:
    audit_record(
        actor=actor,
        action="api_key.delete",
        obj=api_key,
        changes={"tenant": api_key.tenant.slug, "prefix": api_key.prefix},
    )
    api_key.delete()


# --- API tokens (people) -------------------------------------------------------------------

#: A user's tokens beyond this many (the oldest) are revoked when another is issued, so that a
#: script logging in over and over cannot grow the table without bound.
MAX_TOKENS_PER_USER = 100
#: ``last_used_at`` is written at most this often per token, not on every request.
TOKEN_LAST_USED_RESOLUTION = timedelta(minutes=1)


@dataclass(frozen=True)
class IssuedToken:
    """A token just issued, with the only copy of its plaintext."""

    token: AuthToken
    plaintext: str

    def __repr__(self) -> str:
        return f"IssuedToken(token={self.token!r})"


@transaction.atomic
def auth_token_issue(*, user: User, now: datetime | None = None) -> IssuedToken:
    """A new token for ``user``, valid ``FEDINFER_TOKEN_TTL_HOURS``. Each login gets its own
    (only hashes are stored, so an existing token cannot be handed out again); the user's
    expired tokens, and those beyond ``MAX_TOKENS_PER_USER``, go."""
    now = now or timezone.now()
    AuthToken.objects.filter(user=user, expires_at__lte=now).delete()
    keep = AuthToken.objects.filter(user=user).order_by("-created_at", "-id")
    stale = list(keep.values_list("pk", flat=True)[MAX_TOKENS_PER_USER - 1 :])
    if stale:
        AuthToken.objects.filter(pk__in=stale).delete()
    generated = keys.generate_key(keys.TOKEN_PREFIX)
    token = AuthToken.objects.create(
        user=user,
        prefix=generated.prefix,
        key_hash=generated.key_hash,
        expires_at=now + timedelta(hours=settings.FEDINFER_TOKEN_TTL_HOURS),
    )
    return IssuedToken(token=token, plaintext=generated.plaintext)


def auth_token_touch(*, token: AuthToken, now: datetime) -> None:
    """Note that the token was used (at most once per ``TOKEN_LAST_USED_RESOLUTION``)."""
    last = token.last_used_at
    if last is not None and now - last < TOKEN_LAST_USED_RESOLUTION:
        return
    AuthToken.objects.filter(pk=token.pk).update(last_used_at=now)
    token.last_used_at = now


def auth_token_revoke(*, token: AuthToken) -> None:
    AuthToken.objects.filter(pk=token.pk).delete()


def auth_token_revoke_all(*, user: User) -> int:
    """Revoke every token of ``user`` (new password, deactivation); returns how many."""
    deleted, _ = AuthToken.objects.filter(user=user).delete()
    return deleted


# --- users and roles -----------------------------------------------------------------------


def _membership_errors(role: str, tenant: Tenant | None) -> dict[str, list[str]]:
    if role not in Membership.Role.values:
        return {"role": [f"unknown role {role!r}; valid: {sorted(Membership.Role.values)}"]}
    if role == TENANT_VIEWER and tenant is None:
        return {"tenant": ["A tenant viewer needs a tenant."]}
    if role != TENANT_VIEWER and tenant is not None:
        return {"tenant": ["Only tenant viewers belong to a tenant."]}
    return {}


def _password_errors(password: str, user: User) -> dict[str, list[str]]:
    try:
        validate_password(password, user=user)
    except ValidationError as exc:
        return {"password": list(exc.messages)}
    return {}


def _apply_role(user: User, role: str) -> None:
    """Admins get Django admin access; nobody else does."""
    user.is_staff = user.is_superuser = role == ADMIN


@transaction.atomic
def user_create(
    *,
    actor: Actor,
    username: str,
    password: str,
    role: str,
    tenant: Tenant | None = None,
    email: str = "",
) -> User:
    user = User(username=username, email=email)
    errors = _membership_errors(role, tenant) | _password_errors(password, user)
    model_validate(user, extra=errors, exclude=["password"])
    user.set_password(password)
    _apply_role(user, role)
    model_save(user)
    Membership.objects.create(user=user, role=role, tenant=tenant)
    audit_record(
        actor=actor,
        action="user.create",
        obj=user,
        changes={
            "username": username,
            "email": email,
            "role": role,
            "tenant": tenant.slug if tenant else None,
        },
    )
    return user


USER_UPDATABLE = frozenset({"email", "password", "role", "tenant", "is_active"})


@transaction.atomic
def user_update(*, actor: Actor, user: User, data: Mapping[str, Any]) -> User:
    """Change email, password, role/tenant or is_active. A new password or deactivation
    revokes the user's API token. Admins cannot demote or deactivate themselves."""
    model_update_check(user, data, updatable=USER_UPDATABLE)
    user = model_lock(user)
    membership = Membership.objects.filter(user=user).first()
    old_role = role_of(user)
    old_tenant = membership.tenant if membership else None
    role = data.get("role", old_role)
    tenant = data.get("tenant", old_tenant if "role" not in data or role == TENANT_VIEWER else None)
    is_self = actor is not None and getattr(actor, "pk", None) == user.pk
    if is_self and (role != old_role or data.get("is_active") is False):
        raise Conflict("You cannot change your own role or deactivate yourself.", code="self")

    errors: dict[str, list[str]] = {}
    if role is None:
        errors["role"] = ["This user has no role yet; give one."]
    else:
        errors |= _membership_errors(role, tenant)
    plain = {k: data[k] for k in ("email", "is_active") if k in data}
    changes: dict[str, Any] = model_apply(user, plain, updatable=USER_UPDATABLE)
    if "password" in data:
        errors |= _password_errors(data["password"], user)
        changes["password"] = "changed"
    model_validate(user, extra=errors, exclude=["password"])
    if role != old_role:
        changes["role"] = [old_role, role]
    if tenant != old_tenant:
        changes["tenant"] = [
            old_tenant.slug if old_tenant else None,
            tenant.slug if tenant else None,
        ]
    if not changes:
        return user

    if "password" in data:
        user.set_password(data["password"])
    assert role is not None
    _apply_role(user, role)
    user.save()
    Membership.objects.update_or_create(user=user, defaults={"role": role, "tenant": tenant})
    if "password" in data or data.get("is_active") is False:
        auth_token_revoke_all(user=user)
    audit_record(actor=actor, action="user.update", obj=user, changes=changes)
    return user


@transaction.atomic
def user_delete(*, actor: Actor, user: User) -> None:
    if actor is not None and getattr(actor, "pk", None) == user.pk:
        raise Conflict("You cannot delete yourself.", code="self")
    audit_record(actor=actor, action="user.delete", obj=user, changes={"username": user.username})
    user.delete()
