"""The helpers every domain's services write with, so that one failure gets one answer:

* a field a service does not update is the caller's programming error: ``TypeError``, as for
  an unexpected keyword argument;
* field rules (``full_clean``) and the service's own rules are raised together as one
  ``ValidationError`` (400), their error codes kept, so a duplicate alone becomes a 409
  ``duplicate`` (``federation.api.errors``);
* a unique value lost to a concurrent request after ``full_clean`` passed is that same
  duplicate; any other integrity failure on save is a ``Conflict`` ``concurrent_change`` (409).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, TypeVar

from django.core.exceptions import ValidationError
from django.db import IntegrityError, models, transaction

from federation.core.audit import model_diff
from federation.core.errors import Conflict

M = TypeVar("M", bound=models.Model)
#: Messages by field name (``NON_FIELD_ERRORS`` for the whole object).
Errors = dict[str, list[str]]


def model_lock(obj: M) -> M:
    """``obj`` re-read under a row lock, so concurrent writers queue instead of racing."""
    return type(obj)._default_manager.select_for_update().get(pk=obj.pk)


def model_update_check(
    obj: models.Model, data: Mapping[str, Any], *, updatable: Iterable[str]
) -> None:
    """Refuse fields outside ``updatable``: views pass only what their serializers allow."""
    unknown = set(data) - set(updatable)
    if unknown:
        raise TypeError(f"cannot update {sorted(unknown)} of {obj._meta.label}")


def model_apply(
    obj: models.Model, data: Mapping[str, Any], *, updatable: Iterable[str]
) -> dict[str, list[Any]]:
    """Set ``data`` on ``obj`` (unsaved); return the audit diff ``{field: [old, new]}``."""
    model_update_check(obj, data, updatable=updatable)
    diff = model_diff(obj, dict(data))
    for name, value in data.items():
        setattr(obj, name, value)
    return diff


def model_validate(
    obj: models.Model,
    *,
    extra: Mapping[str, Iterable[str]] | None = None,
    exclude: Sequence[str] | None = None,
) -> None:
    """``full_clean`` plus the service's ``extra`` errors, raised together in one
    ``ValidationError`` with Django's error codes (``unique``…) kept."""
    errors: dict[str, list[ValidationError]] = {}
    try:
        obj.full_clean(exclude=exclude)
    except ValidationError as exc:
        for field, found in exc.error_dict.items():
            errors.setdefault(field, []).extend(found)
    for field, messages in (extra or {}).items():
        errors.setdefault(field, []).extend(ValidationError(m) for m in messages)
    if errors:
        raise ValidationError(errors)


def model_save(obj: M) -> M:
    """Save a validated ``obj``. Between ``full_clean`` and the insert a concurrent request may
    have taken one of its unique values: that is the duplicate ``full_clean`` would now
    report, so it is raised as such; anything else the database refuses is a ``Conflict``."""
    try:
        with transaction.atomic():
            obj.save()
    except IntegrityError as exc:
        obj.validate_unique()
        obj.validate_constraints()
        raise Conflict(
            f"{obj._meta.verbose_name} conflicts with a concurrent change; retry.",
            code="concurrent_change",
        ) from exc
    return obj
