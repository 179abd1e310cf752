"""A FilterSet base whose query parameters mean exactly what the OpenAPI schema says.

django-filter is lenient by default: ``?rdma=null`` is read as "no filter" and
``?pool=0`` (an id that does not exist) is a 400. A client (or schemathesis) reading the schema
expects the opposite: a boolean parameter takes ``true``/``false`` only, and an integer id that
matches nothing simply matches nothing. Date-times are read in UTC, or refused when that falls
outside what PostgreSQL stores (``federation.api.fields.to_utc``).
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

import django_filters as df
from django import forms
from django.core.exceptions import ValidationError
from django.db import models
from django_filters.fields import IsoDateTimeField
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import extend_schema_field

from federation.api.fields import to_utc

_TRUE = frozenset({"true", "True", "1"})
_FALSE = frozenset({"false", "False", "0"})


class StrictBooleanField(forms.Field):
    def to_python(self, value: Any) -> bool | None:
        if value in (None, ""):
            return None
        if value in _TRUE:
            return True
        if value in _FALSE:
            return False
        raise ValidationError("Use true or false.", code="invalid")


@extend_schema_field(OpenApiTypes.BOOL)
class StrictBooleanFilter(df.BooleanFilter):
    field_class = StrictBooleanField


@extend_schema_field(OpenApiTypes.INT)
class IntegerFilter(df.NumberFilter):
    """A whole-number filter (NumberFilter would accept and document decimals)."""

    field_class = forms.IntegerField


_MULTIPLE_VALUE_FIELDS = (forms.MultipleChoiceField, forms.ModelMultipleChoiceField)


class StrictFilterSet(df.FilterSet):
    FILTER_DEFAULTS = {
        **df.FilterSet.FILTER_DEFAULTS,
        models.BooleanField: {"filter_class": StrictBooleanFilter},
        # Filter foreign keys by id: an unknown id matches nothing instead of a 400.
        models.ForeignKey: {"filter_class": IntegerFilter},
        models.OneToOneField: {"filter_class": IntegerFilter},
    }

    def is_valid(self) -> bool:
        """Also refuse a single-value parameter given twice (``?pool=1&pool=2``): django-filter
        would silently use the last one (the API fuzzer)."""
        valid: bool = super().is_valid()
        getlist = getattr(self.data, "getlist", None)
        if getlist is None:
            return valid
        for name, filter_ in self.filters.items():
            if issubclass(filter_.field_class, _MULTIPLE_VALUE_FIELDS) or len(getlist(name)) < 2:
                continue
            if name in self.form.fields and name not in self.form.errors:
                self.form.add_error(name, "Give this parameter once.")
            valid = False
        return valid


class UTCIsoDateTimeFormField(IsoDateTimeField):
    def to_python(self, value: Any) -> datetime | None:
        parsed = super().to_python(value)
        if parsed is None:
            return None
        try:
            return to_utc(parsed)
        except OverflowError as exc:
            raise forms.ValidationError("Date-time out of range.", code="invalid") from exc


class UTCIsoDateTimeFilter(df.IsoDateTimeFilter):
    field_class = UTCIsoDateTimeFormField
