"""Building blocks shared by every API serializer."""

from __future__ import annotations

from typing import Any

from rest_framework import serializers

_NUMBER_FIELDS = (serializers.IntegerField, serializers.FloatField)


class StrictFieldsMixin:
    """Input means what the schema says.

    * Unknown fields are refused with a 400 naming them, instead of being silently dropped:
      a typo such as ``{"node_cout": 4}`` would otherwise be accepted and ignored.
    * Integer and float fields take JSON numbers only: DRF would read ``false`` as 0 and
      ``"12"`` as 12. (Decimal fields take strings too: their schema says so, to keep
      precision.)
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
            if errors:
                raise serializers.ValidationError(errors)
        return super().to_internal_value(data)  # type: ignore[misc]
