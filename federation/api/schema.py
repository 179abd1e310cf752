"""OpenAPI details drf-spectacular cannot infer, for every view (``DEFAULT_SCHEMA_CLASS``).

* Error responses: every operation documents the 4xx it can answer (with their bodies), so a
  client generator or schemathesis sees the real contract, not just the happy path.
* Strict request bodies: input serializers refuse unknown fields (``StrictFieldsMixin``), so
  their schemas say ``additionalProperties: false``.
* Decimal strings: a pattern that needs a digit and has a sign only where one is allowed.
* Filters: an empty value (``?status=``, ``?created_before=``) means "no filter" to
  django-filter, so each filter's schema says it takes one (the API fuzzer found them
  accepted but undocumented).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from drf_spectacular import openapi
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiResponse, extend_schema, extend_schema_view
from rest_framework import serializers
from rest_framework.serializers import BaseSerializer

from federation.api.serializers import StrictFieldsMixin


class ErrorOutput(serializers.Serializer):
    detail = serializers.CharField()
    code = serializers.CharField(required=False)


FIELD_ERRORS = OpenApiResponse(
    response=OpenApiTypes.OBJECT,
    description="Invalid input: an object of field name (or non_field_errors) to messages.",
)
UNAUTHENTICATED = OpenApiResponse(ErrorOutput, description="No or invalid credentials.")
FORBIDDEN = OpenApiResponse(ErrorOutput, description="Your role does not allow this.")
NOT_FOUND = OpenApiResponse(ErrorOutput, description="No such object, or not visible to you.")
CONFLICT = OpenApiResponse(
    ErrorOutput, description="Conflicts with the current state, or the object is still in use."
)
TOO_LARGE = OpenApiResponse(ErrorOutput, description="The request body exceeds the size limit.")


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


def _empty_allowed(schema: dict[str, Any]) -> dict[str, Any]:
    """A django-filter parameter's schema that also takes ``""``: an empty value is no filter
    (``?status=``, ``?created_before=``). Lists (``?state=a&state=b``) stay as they are."""
    if schema.get("type") == "array" or schema == {"type": "string"}:
        return schema
    if "enum" in schema:
        return schema if "" in schema["enum"] else {**schema, "enum": [*schema["enum"], ""]}
    return {"anyOf": [schema, {"type": "string", "maxLength": 0}]}


class AutoSchema(openapi.AutoSchema):
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

    def _get_filter_parameters(self) -> list[dict[str, Any]]:
        parameters: list[dict[str, Any]] = super()._get_filter_parameters()
        filterset = getattr(self.view, "filterset_class", None)
        filters = filterset.base_filters if filterset is not None else {}
        for parameter in parameters:
            if parameter["name"] in filters:
                parameter["schema"] = _empty_allowed(parameter.get("schema", {}))
        return parameters

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


def crud_schema(
    *,
    out: type[BaseSerializer],
    create: type[BaseSerializer],
    update: type[BaseSerializer],
    created: type[BaseSerializer] | None = None,
) -> Callable[[type], type]:
    """Document that the view's writes take the input serializer and answer with the output
    one (or ``created`` for a create whose answer differs, such as a key shown once)."""
    operations = {
        "create": extend_schema(request=create, responses={201: created or out}),
        "update": extend_schema(request=update, responses={200: out}),
        "partial_update": extend_schema(request=update, responses={200: out}),
    }

    def decorate(view: type) -> type:
        present = {name: doc for name, doc in operations.items() if hasattr(view, name)}
        return extend_schema_view(**present)(view)

    return decorate
