"""Tenants, their API keys and the people who use the console and API."""

from __future__ import annotations

from datetime import datetime

from django.conf import settings
from django.core.validators import MinValueValidator
from django.db import models

from federation.core.models import TimeStampedModel
from federation.inventory.models import Region, slug_validator


class Tenant(TimeStampedModel):
    """A customer. Its residency policy says where its requests may be served.

    Residency: a region is allowed when its jurisdiction is in ``allowed_jurisdictions`` (empty
    list: any jurisdiction) and, if ``allowed_regions`` is not empty, it is one of them.
    """

    slug = models.CharField(max_length=63, unique=True, validators=[slug_validator])
    name = models.CharField(max_length=200)
    allowed_jurisdictions = models.JSONField(
        default=list, blank=True, help_text="Jurisdiction codes, e.g. ['EU']; empty = any."
    )
    allowed_regions = models.ManyToManyField(Region, blank=True, related_name="tenants")
    requests_per_minute = models.PositiveIntegerField(
        null=True, blank=True, validators=[MinValueValidator(1)], help_text="Empty = unlimited."
    )
    tokens_per_minute = models.PositiveIntegerField(
        null=True, blank=True, validators=[MinValueValidator(1)], help_text="Empty = unlimited."
    )
    monthly_budget_usd = models.DecimalField(
        max_digits=14,
        decimal_places=2,
        null=True,
        blank=True,
        validators=[MinValueValidator(0)],
        help_text="Empty = no budget limit.",
    )
    isolate_kv_cache = models.BooleanField(
        default=False,
        help_text=(
            "Its prompts' KV cache is its own: engines never share cached prefixes with other "
            "tenants (no timing signal of its prompts; no cache hits from shared prompts)."
        ),
    )
    is_active = models.BooleanField(default=True)

    class Meta:
        ordering = ["slug"]

    def __str__(self) -> str:
        return self.slug


class ApiKey(TimeStampedModel):
    """An inference key. Only its SHA-256 hash and a visible prefix are stored."""

    class Scope(models.TextChoices):
        INFERENCE = "inference", "Inference"
        USAGE_READ = "usage:read", "Read usage"

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="api_keys")
    name = models.CharField(max_length=100)
    prefix = models.CharField(
        max_length=16, unique=True, help_text="Shown in lists: 'fi_AbC123xY'."
    )
    key_hash = models.CharField(max_length=64, unique=True)
    previous_key_hash = models.CharField(
        max_length=64,
        blank=True,
        default="",
        help_text="Hash of the secret replaced by the last rotation; valid until the time below.",
    )
    previous_key_valid_until = models.DateTimeField(null=True, blank=True)
    previous_prefix = models.CharField(
        max_length=16,
        blank=True,
        default="",
        help_text="Prefix of the secret replaced by the last rotation (its requests carry it).",
    )
    scopes = models.JSONField(default=list)
    monthly_budget_usd = models.DecimalField(
        max_digits=14,
        decimal_places=2,
        null=True,
        blank=True,
        validators=[MinValueValidator(0)],
        help_text="Empty = no budget of its own (the tenant's still applies).",
    )
    expires_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)
    last_used_at = models.DateTimeField(null=True, blank=True)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="+",
    )

    class Meta:
        ordering = ["tenant__slug", "name", "id"]

    def __str__(self) -> str:
        return f"{self.prefix}… ({self.tenant_id})"

    def status_at(self, now: datetime) -> str:
        """'revoked', 'expired' or 'active' at ``now``."""
        if self.revoked_at is not None:
            return "revoked"
        if self.expires_at is not None and self.expires_at <= now:
            return "expired"
        return "active"


class ApiKeyPrefix(models.Model):
    """Every public prefix a key has had: usage records name a key by the prefix of the secret
    that sent it, and a rotation changes it, so a key's spend is that of all its prefixes.
    A prefix is never given to another key (``services._unused_key``)."""

    api_key = models.ForeignKey(ApiKey, on_delete=models.CASCADE, related_name="prefixes")
    prefix = models.CharField(max_length=16, unique=True)
    created_at = models.DateTimeField()

    class Meta:
        ordering = ["api_key", "created_at", "id"]

    def __str__(self) -> str:
        return f"{self.prefix} ({self.api_key_id})"


class Membership(TimeStampedModel):
    """A user's role. A tenant viewer is bound to exactly one tenant and sees only its data."""

    class Role(models.TextChoices):
        ADMIN = "admin", "Admin"
        OPERATOR = "operator", "Operator"
        TENANT_VIEWER = "tenant_viewer", "Tenant viewer"

    user = models.OneToOneField(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="membership"
    )
    role = models.CharField(max_length=16, choices=Role.choices)
    tenant = models.ForeignKey(
        Tenant, null=True, blank=True, on_delete=models.CASCADE, related_name="members"
    )

    class Meta:
        ordering = ["user__username"]
        constraints = [
            models.CheckConstraint(
                condition=(models.Q(role="tenant_viewer") & models.Q(tenant__isnull=False))
                | (~models.Q(role="tenant_viewer") & models.Q(tenant__isnull=True)),
                name="membership_tenant_iff_viewer",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.user_id}:{self.role}"


class AuthToken(models.Model):
    """A person's API token (``Authorization: Token <key>``), issued by ``POST /auth/token/``.

    Like an API key, only the SHA-256 of the token and a visible prefix are stored, so a copy
    of the database yields no usable token; unlike one, it expires (``FEDINFER_TOKEN_TTL_HOURS``
    after it is issued) and acts as its user, with the user's role.
    """

    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="auth_tokens"
    )
    prefix = models.CharField(max_length=16, help_text="Shown in lists: 'ft_AbC123xY'.")
    key_hash = models.CharField(max_length=64, unique=True)
    created_at = models.DateTimeField(auto_now_add=True)
    expires_at = models.DateTimeField()
    last_used_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at", "-id"]
        indexes = [models.Index(fields=["user", "expires_at"], name="authtoken_user_expiry")]

    def __str__(self) -> str:
        return f"{self.prefix}… ({self.user_id})"

    def is_expired(self, now: datetime) -> bool:
        return self.expires_at <= now
