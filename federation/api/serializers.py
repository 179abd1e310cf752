"""Building blocks shared by every API serializer."""

from __future__ import annotations

from typing import Any

from rest_framework import serializers


class StrictFieldsMixin:
    """Refuse unknown fields with a 400 naming them, instead of silently dropping them.

    A typo such as ``{"node_cout": 4}`` would otherwise be accepted and ignored.
    """

    def to_internal_value(self, data: Any) -> Any:
        if isinstance(data, dict):
            known = {name for name, field in self.fields.items() if not field.read_only}  # type: ignore[attr-defined]
            unknown = sorted(set(data) - known)
            if unknown:
                raise serializers.ValidationError({name: ["Unknown field."] for name in unknown})
        return super().to_internal_value(data)  # type: ignore[misc]
