"""Serializer fields that take what the OpenAPI schema says and nothing looser.

* Strict scalars: JSON strings, booleans and integers only (DRF would coerce ``0`` to
  ``"0"``, ``"yes"`` to True and ``"12"`` to 12).
* Datetimes PostgreSQL can always store: Python accepts UTC offsets up to ±23:59 and years
  1-9999; PostgreSQL refuses offsets beyond ±15:59 and Python cannot shift 0001-01-01 or
  9999-12-31 across midnight. Converting every input to UTC here turns those corners into a
  clear 400 instead of a database error (500).
* References by slug that refuse NUL characters, which PostgreSQL text cannot hold.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers
from rest_framework.relations import MANY_RELATION_KWARGS


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


class StrictCharField(serializers.CharField):
    """JSON strings only: DRF would store ``{"name": 0}`` as "0"."""

    def to_internal_value(self, data: Any) -> str:
        if not isinstance(data, str):
            self.fail("invalid")
        return str(super().to_internal_value(data))


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


#: An amount as a string: what the schema says, and all MoneyField takes as a string.
MONEY_PATTERN = r"^\d{1,12}(?:\.\d{1,2})?$"


@extend_schema_field(
    {
        "oneOf": [
            {"type": "string", "format": "decimal", "pattern": MONEY_PATTERN},
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

    def validate_empty_values(self, data: Any) -> tuple[bool, Any]:
        # DRF reads a blank string as null when null is allowed; the schema says null, not ""
        # (the API fuzzer's "schema-violating request accepted").
        if isinstance(data, str) and not data.strip():
            self.fail("invalid")
        return super().validate_empty_values(data)

    def to_internal_value(self, data: Any) -> Decimal:
        # Decimal() also reads " 12 ", "1E2" and "0000000000000012": not amounts the schema
        # describes.
        if isinstance(data, str) and re.fullmatch(MONEY_PATTERN, data) is None:
            self.fail("invalid")
        value: Decimal = super().to_internal_value(data)
        return value


class StrictManyRelatedField(serializers.ManyRelatedField):
    """A JSON array only: DRF iterates anything iterable, so ``{"eu-west": 1}`` read as the
    list of its keys (the API fuzzer)."""

    def to_internal_value(self, data: Any) -> Any:
        if not isinstance(data, list):
            self.fail("not_a_list", input_type=type(data).__name__)
        return super().to_internal_value(data)


class SlugLookupField(serializers.SlugRelatedField[Any]):
    """A reference by slug (a region code, a tenant slug): a JSON string (``0`` is not the
    region ``"0"``), without NUL characters, which PostgreSQL cannot even compare, so the
    lookup would fail with a server error; ``many=True`` takes a JSON array only."""

    @classmethod
    def many_init(cls, *args: Any, **kwargs: Any) -> StrictManyRelatedField:
        list_kwargs: dict[str, Any] = {"child_relation": cls(*args, **kwargs)}
        list_kwargs.update({k: v for k, v in kwargs.items() if k in MANY_RELATION_KWARGS})
        return StrictManyRelatedField(**list_kwargs)

    def run_validation(self, data: Any = serializers.empty) -> Any:
        # DRF's related fields take "" for null; a reference is a slug or an explicit null.
        if data == "":
            raise serializers.ValidationError("This field may not be blank.")
        return super().run_validation(data)

    def to_internal_value(self, data: Any) -> Any:
        if not isinstance(data, str):
            self.fail("invalid")
        if "\x00" in data:
            raise serializers.ValidationError("Null characters are not allowed.")
        return super().to_internal_value(data)
