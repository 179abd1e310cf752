"""One error shape for the API: DRF's, also for errors raised by services.

Services raise ``django.core.exceptions.ValidationError`` (bad input, impossible
configuration), ``federation.core.errors.Conflict`` (illegal state transition, object in use)
and ``django.db.models.ProtectedError``; here they become 400 and 409 responses.
"""

from __future__ import annotations

from typing import Any

from django.core.exceptions import NON_FIELD_ERRORS
from django.core.exceptions import ValidationError as DjangoValidationError
from django.db.models import ProtectedError, RestrictedError
from rest_framework import exceptions, status
from rest_framework.response import Response
from rest_framework.serializers import as_serializer_error
from rest_framework.settings import api_settings
from rest_framework.views import exception_handler as drf_exception_handler

from federation.core.errors import Conflict

#: Error codes meaning "another object already has this": a conflict with the stored state,
#: not a malformed request, so the answer is 409 (a client can tell it apart and look it up).
UNIQUENESS_CODES = frozenset({"unique", "unique_together", "unique_constraint"})


def _codes(detail: Any) -> set[str]:
    """Every error code in a DRF ``get_codes()`` structure."""
    if isinstance(detail, dict):
        return {code for value in detail.values() for code in _codes(value)}
    if isinstance(detail, list):
        return {code for value in detail for code in _codes(value)}
    return {str(detail)}


def _as_drf(exc: DjangoValidationError) -> exceptions.ValidationError:
    """A service's Django ValidationError as DRF's, keeping the codes."""
    detail = as_serializer_error(exc)
    # Django keys whole-object errors (unique constraints, cross-field rules) "__all__";
    # DRF clients expect them under "non_field_errors", as serializers report them.
    if NON_FIELD_ERRORS in detail:
        detail[api_settings.NON_FIELD_ERRORS_KEY] = detail.pop(NON_FIELD_ERRORS)
    return exceptions.ValidationError(detail)


def exception_handler(exc: Exception, context: dict[str, Any]) -> Response | None:
    if isinstance(exc, DjangoValidationError):
        exc = _as_drf(exc)
    if isinstance(exc, exceptions.ValidationError):
        codes = _codes(exc.get_codes())
        if codes and codes <= UNIQUENESS_CODES:
            return _duplicate_response(exc)
        return drf_exception_handler(exc, context)
    return _other_response(exc, context)


def _duplicate_response(exc: exceptions.ValidationError) -> Response:
    """409 in the one conflict shape (``detail``, ``code``), with the per-field messages."""
    fields = exc.detail if isinstance(exc.detail, dict) else {"non_field_errors": exc.detail}
    summary = "; ".join(
        f"{field}: {' '.join(str(m) for m in messages)}"
        if isinstance(messages, list)
        else f"{field}: {messages}"
        for field, messages in fields.items()
    )
    return Response(
        {"detail": f"Already exists ({summary}).", "code": "duplicate", "errors": fields},
        status=status.HTTP_409_CONFLICT,
    )


def _other_response(exc: Exception, context: dict[str, Any]) -> Response | None:
    if isinstance(exc, ProtectedError | RestrictedError):
        blockers = (
            exc.protected_objects if isinstance(exc, ProtectedError) else exc.restricted_objects
        )
        names = sorted({str(o._meta.verbose_name_plural) for o in blockers})
        return Response(
            {"detail": f"Cannot delete: still used by {', '.join(names)}.", "code": "protected"},
            status=status.HTTP_409_CONFLICT,
        )
    if isinstance(exc, Conflict):
        return Response({"detail": str(exc), "code": exc.code}, status=status.HTTP_409_CONFLICT)
    return drf_exception_handler(exc, context)
