"""OpenAPI details drf-spectacular cannot infer for the inventory views.

* Error responses: every operation documents the 4xx it can answer (with their bodies), so a
  client generator or schemathesis sees the real contract, not just the happy path.
* Strict request bodies: input serializers refuse unknown fields (``StrictFieldsMixin``), so
  their schemas say ``additionalProperties: false``.

Nothing here is inventory-specific; it could serve every app's views from ``federation.api``.
"""

from __future__ import annotations

from typing import Any

from drf_spectacular.openapi import AutoSchema
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiResponse
from rest_framework import serializers

from federation.api.serializers import StrictFieldsMixin


class ErrorOut(serializers.Serializer):
    detail = serializers.CharField()
    code = serializers.CharField(required=False)


FIELD_ERRORS = OpenApiResponse(
    response=OpenApiTypes.OBJECT,
    description="Invalid input: an object of field name (or non_field_errors) to messages.",
)
UNAUTHENTICATED = OpenApiResponse(ErrorOut, description="No or invalid credentials.")
FORBIDDEN = OpenApiResponse(ErrorOut, description="Your role does not allow this.")
NOT_FOUND = OpenApiResponse(ErrorOut, description="No such object.")
CONFLICT = OpenApiResponse(
    ErrorOut, description="Conflicts with the current state, or the object is still in use."
)
TOO_LARGE = OpenApiResponse(ErrorOut, description="The request body exceeds the size limit.")


def _decimal_pattern(field: serializers.DecimalField) -> str:
    """drf-spectacular's decimal pattern also matches "", "-" and "."; this one needs a
    digit, and has no minus sign when the field refuses negatives."""
    places = field.decimal_places or 0
    whole = (field.max_digits or 30) - places
    sign = "" if field.min_value is not None and field.min_value >= 0 else "-?"
    fraction = rf"(?:\.\d{{0,{places}}})?" if places else ""
    alternatives = [rf"\d{{1,{whole}}}{fraction}"] if whole else []
    if places:
        alternatives.append(rf"\.\d{{1,{places}}}")
    return rf"^{sign}(?:{'|'.join(alternatives)})$"


class InventoryAutoSchema(AutoSchema):
    def _error_responses(self) -> dict[str, OpenApiResponse]:
        errors = {"401": UNAUTHENTICATED, "403": FORBIDDEN, "400": FIELD_ERRORS}
        if "{" in self.path:
            errors["404"] = NOT_FOUND
        if self.method in {"POST", "PUT", "PATCH", "DELETE"}:
            errors["409"] = CONFLICT
        if self.method in {"POST", "PUT", "PATCH"}:
            errors["413"] = TOO_LARGE
        return errors

    def _get_response_bodies(self, direction: Any = "response") -> dict[str, Any]:
        responses = super()._get_response_bodies(direction)
        if direction == "response":
            for code, response in self._error_responses().items():
                responses.setdefault(
                    code, self._get_response_for_code(response, code, direction=direction)
                )
        return responses

    def _map_serializer_field(
        self, field: Any, direction: Any, bypass_extensions: bool = False
    ) -> dict[str, Any]:
        schema = super()._map_serializer_field(field, direction, bypass_extensions)
        if isinstance(field, serializers.DecimalField) and schema.get("type") == "string":
            schema["pattern"] = _decimal_pattern(field)
        return schema

    def _map_serializer(
        self, serializer: Any, direction: Any, bypass_extensions: bool = False
    ) -> dict[str, Any]:
        schema = super()._map_serializer(serializer, direction, bypass_extensions)
        if direction == "request" and isinstance(serializer, StrictFieldsMixin):
            schema["additionalProperties"] = False
        if not type(serializer).__dict__.get("__doc__"):
            # inspect.getdoc() inherits a base class's docstring, which describes the base
            # (e.g. StrictFieldsMixin), not this body.
            schema.pop("description", None)
        return schema
