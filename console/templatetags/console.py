"""Template helpers of the console: the user's role, numbers and shares as people read them."""

from __future__ import annotations

from typing import Any

from django import template

from federation.core.roles import role_of

register = template.Library()


@register.filter
def console_role(user: Any) -> str:
    return role_of(user) or ""


@register.filter
def percent(value: float | None, digits: int = 0) -> str:
    if value is None:
        return "—"
    return f"{value * 100:.{digits}f} %"


@register.filter
def ms(value: float | None) -> str:
    return "—" if value is None else f"{value:.0f} ms"


@register.filter
def usd(value: Any, digits: int = 2) -> str:
    if value is None:
        return "—"
    return f"${float(value):,.{digits}f}"


#: URL name prefixes and the navigation entry they belong to.
_SECTIONS = (
    ("overview", "overview"),
    ("region", "regions"),
    ("pool", "regions"),
    ("instance", "regions"),
    ("models", "models"),
    ("routing", "routing"),
    ("inspect", "routing"),
    ("tenant", "tenants"),
    ("key", "tenants"),
    ("usage", "usage"),
    ("costs", "costs"),
    ("audit", "audit"),
    ("dead-letter", "dead-letters"),
    ("users", "users"),
)


@register.filter
def nav_section(url_name: str | None) -> str:
    """The navigation entry a page is under, from its URL name."""
    for prefix, section in _SECTIONS:
        if url_name and url_name.startswith(prefix):
            return section
    return ""


@register.filter
def key_status(key: Any, now: Any) -> str:
    """An API key's status at ``now``: 'active', 'expired' or 'revoked'."""
    return str(key.status_at(now))


@register.filter
def fill_class(share: float | None) -> str:
    """A meter's width as a class (``w-0`` … ``w-100``, console.css): the CSP allows no
    ``style`` attribute, and a share over 1 fills the meter."""
    if share is None:
        return "w-0"
    return f"w-{max(0, min(100, round(float(share) * 100)))}"
