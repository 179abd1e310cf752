"""OpenAPI extensions: make the schema say what the API already enforces."""

from __future__ import annotations

from typing import Any

from drf_spectacular.extensions import OpenApiSerializerExtension


class StrictFieldsExtension(OpenApiSerializerExtension):
    """Input serializers with ``StrictFieldsMixin`` refuse unknown fields with a 400, so their
    schema declares ``additionalProperties: false`` and clients (and fuzzers) know it."""

    target_class = "federation.api.serializers.StrictFieldsMixin"
    match_subclasses = True

    def map_serializer(self, auto_schema: Any, direction: Any) -> Any:
        schema = auto_schema._map_serializer(self.target, direction, bypass_extensions=True)
        if direction == "request":
            schema["additionalProperties"] = False
        return schema
