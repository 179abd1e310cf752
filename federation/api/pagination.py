from __future__ import annotations

from typing import Any

from rest_framework.exceptions import ValidationError
from rest_framework.pagination import LimitOffsetPagination
from rest_framework.request import Request


def query_whole_number(request: Request, name: str, minimum: int) -> int | None:
    """Query parameter ``name`` as a whole number of at least ``minimum`` (None when absent);
    given twice, not a number or too small is a 400 naming it."""
    raw = request.query_params.getlist(name)
    if not raw:
        return None
    if len(raw) > 1:
        raise ValidationError({name: ["Give this parameter once."]})
    try:
        value = int(raw[0])
    except ValueError:
        raise ValidationError({name: ["A whole number is required."]}) from None
    if value < minimum:
        raise ValidationError({name: [f"Must be at least {minimum}."]})
    return value


class Pagination(LimitOffsetPagination):
    """``?limit=&offset=``. Malformed values are a 400 (DRF would silently ignore them), and
    limits are capped so one request cannot dump a huge table."""

    default_limit = 50
    max_limit = 1000

    def get_limit(self, request: Request) -> int:
        limit = query_whole_number(request, self.limit_query_param, 1)
        return self.default_limit if limit is None else min(limit, self.max_limit)

    def get_offset(self, request: Request) -> int:
        offset = query_whole_number(request, self.offset_query_param, 0)
        return 0 if offset is None else offset

    def get_schema_operation_parameters(self, view: Any) -> list[dict[str, Any]]:
        params = super().get_schema_operation_parameters(view)
        for param in params:
            if param["name"] == self.limit_query_param:
                # Larger limits are accepted and capped, so the schema states no maximum.
                param["schema"]["minimum"] = 1
                param["description"] += f" At most {self.max_limit} are returned."
            elif param["name"] == self.offset_query_param:
                param["schema"]["minimum"] = 0
        return params
