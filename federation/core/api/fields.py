"""Datetime input that PostgreSQL can always store.

Python accepts UTC offsets up to ±23:59 and years 1-9999; PostgreSQL refuses offsets beyond
±15:59 and Python cannot shift 0001-01-01 or 9999-12-31 across midnight. Converting every
input to UTC here turns those corners into a clear 400 instead of a database error (500).
"""

from __future__ import annotations

from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

import django_filters
from django import forms
from django_filters.fields import IsoDateTimeField
from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers


def to_utc(value: datetime) -> datetime:
    """``value`` in UTC; ``OverflowError`` when that falls outside years 1-9999."""
    return value.astimezone(UTC)


class UTCDateTimeField(serializers.DateTimeField):
    def to_internal_value(self, value: Any) -> datetime:
        parsed = super().to_internal_value(value)
        try:
            return to_utc(parsed)
        except OverflowError:
            self.fail("invalid", format="an ISO 8601 date-time between years 1 and 9999")
            raise  # unreachable: fail() raises


class UTCIsoDateTimeFormField(IsoDateTimeField):
    def to_python(self, value: Any) -> datetime | None:
        parsed = super().to_python(value)
        if parsed is None:
            return None
        try:
            return to_utc(parsed)
        except OverflowError as exc:
            raise forms.ValidationError("Date-time out of range.", code="invalid") from exc


class UTCIsoDateTimeFilter(django_filters.IsoDateTimeFilter):
    field_class = UTCIsoDateTimeFormField


class StrictBooleanField(serializers.BooleanField):
    """JSON ``true``/``false`` only: ``0``, ``"yes"`` or ``"false"`` are a wrong type, not a
    guess (DRF's BooleanField would read ``"false"`` as False and ``0`` as False)."""

    def to_internal_value(self, data: Any) -> bool:
        if not isinstance(data, bool):
            self.fail("invalid", input=data)
        return data


class StrictIntegerField(serializers.IntegerField):
    """JSON integers only: ``"600"``, ``6.0`` and ``true`` are a wrong type."""

    default_error_messages = {"invalid": "A JSON integer is required."}

    def to_internal_value(self, data: Any) -> int:
        if isinstance(data, bool) or not isinstance(data, int):
            self.fail("invalid")
        return int(super().to_internal_value(data))


@extend_schema_field(
    {
        "oneOf": [
            {"type": "string", "format": "decimal", "pattern": r"^\d{1,12}(?:\.\d{1,2})?$"},
            {"type": "number", "minimum": 0, "maximum": 999_999_999_999.99},
        ],
        "nullable": True,
        "example": "1500.00",
    }
)
class MoneyField(serializers.DecimalField):
    """A non-negative amount with two decimals, as a string ("1500.00", exact) or a JSON
    number (1500); the schema says both, since both are accepted."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(max_digits=14, decimal_places=2, min_value=Decimal(0), **kwargs)
