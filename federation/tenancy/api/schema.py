"""OpenAPI: the edge credential is a Bearer security scheme."""

from __future__ import annotations

from typing import Any

from drf_spectacular.extensions import OpenApiAuthenticationExtension


class EdgeCredentialScheme(OpenApiAuthenticationExtension):
    target_class = "federation.tenancy.api.authentication.EdgeCredentialAuthentication"
    name = "edgeCredential"

    def get_security_definition(self, auto_schema: Any) -> dict[str, Any]:
        return {
            "type": "http",
            "scheme": "bearer",
            "description": "An edge's credential (POST /api/v1/edges/{id}/rotate-credential).",
        }
