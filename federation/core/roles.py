"""Who may do what. A user's role comes from its Membership; superusers are admins."""

from __future__ import annotations

from typing import Any

ADMIN = "admin"
OPERATOR = "operator"
TENANT_VIEWER = "tenant_viewer"


def role_of(user: Any) -> str | None:
    """The user's role, or None for anonymous users and users without a membership."""
    if user is None or not user.is_authenticated:
        return None
    if user.is_superuser:
        return ADMIN
    membership = getattr(user, "membership", None)
    return membership.role if membership is not None else None


def tenant_id_of(user: Any) -> int | None:
    """The tenant a tenant viewer is bound to (None for everyone else)."""
    if role_of(user) != TENANT_VIEWER:
        return None
    return user.membership.tenant_id


def is_staff_role(user: Any) -> bool:
    return role_of(user) in {ADMIN, OPERATOR}
