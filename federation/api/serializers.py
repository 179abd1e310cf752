"""The base classes of every API serializer.

Naming: a body a client sends is an ``<Entity>[<Action>]Input``, a body it gets back an
``<Entity>Output``; kept apart, so what a client may send and what it gets back are separate,
documented shapes (OpenAPI components of the same names, ``…InputRequest`` for the request
side).
"""

from __future__ import annotations

from typing import Any

from rest_framework import serializers

from federation.api.fields import StrictBooleanField, StrictCharField

_NUMBER_FIELDS = (serializers.IntegerField, serializers.FloatField)


class StrictFieldsMixin:
    """Input means what the schema says.

    * Unknown fields are refused with a 400 naming them, instead of being silently dropped:
      a typo such as ``{"node_cout": 4}`` would otherwise be accepted and ignored.
    * Integer and float fields take JSON numbers only: DRF would read ``false`` as 0 and
      ``"12"`` as 12. (Decimal fields take strings too: their schema says so, to keep
      precision.)
    * String fields take JSON strings only: DRF would store ``{"name": 0}`` as "0" (the API
      fuzzer).
    """

    def to_internal_value(self, data: Any) -> Any:
        if isinstance(data, dict):
            fields = self.fields  # type: ignore[attr-defined]
            known = {name for name, field in fields.items() if not field.read_only}
            errors: dict[str, list[str]] = {
                name: ["Unknown field."] for name in sorted(set(data) - known)
            }
            for name, value in data.items():
                field = fields.get(name)
                if (
                    isinstance(field, _NUMBER_FIELDS)
                    and value is not None
                    and (isinstance(value, bool) or not isinstance(value, int | float))
                ):
                    errors[name] = ["A number is required."]
                elif (
                    isinstance(field, serializers.CharField)
                    and value is not None
                    and not isinstance(value, str)
                ):
                    errors[name] = ["Not a valid string."]
            if errors:
                raise serializers.ValidationError(errors)
        return super().to_internal_value(data)  # type: ignore[misc]


class InputSerializer(StrictFieldsMixin, serializers.Serializer):
    """Base of input bodies declared field by field."""


# Numbers are already held to JSON numbers by StrictFieldsMixin.
_STRICT_MODEL_FIELDS = {
    serializers.CharField: StrictCharField,
    serializers.BooleanField: StrictBooleanField,
}


class ModelInputSerializer(StrictFieldsMixin, serializers.ModelSerializer):
    """Base of input bodies taken from a model's fields: unknown fields and loosely typed JSON
    values are refused."""

    serializer_field_mapping = {
        model_field: _STRICT_MODEL_FIELDS.get(field, field)
        for model_field, field in serializers.ModelSerializer.serializer_field_mapping.items()
    }


class OutputModelSerializer(serializers.ModelSerializer):
    """Base of output bodies taken from a model: every field is read-only."""

    def get_fields(self) -> dict[str, serializers.Field]:
        fields = super().get_fields()
        for field in fields.values():
            field.read_only = True
        return fields
