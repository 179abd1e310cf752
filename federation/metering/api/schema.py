"""OpenAPI: a ``usage:read`` API key is a Bearer security scheme."""

from __future__ import annotations

from typing import Any

from drf_spectacular.extensions import OpenApiAuthenticationExtension


class UsageKeyScheme(OpenApiAuthenticationExtension):
    target_class = "federation.metering.api.reports.UsageKeyAuthentication"
    name = "usageKey"

    def get_security_definition(self, auto_schema: Any) -> dict[str, Any]:
        return {
            "type": "http",
            "scheme": "bearer",
            "description": "A tenant's API key with the 'usage:read' scope (fi_…).",
        }
