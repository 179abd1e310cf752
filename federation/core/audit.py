"""Writing audit events. Every service that changes state calls ``audit_record``, which also
hands the event to the routing tables' scheduler (``federation.core.changes``): a change to
what a table compiles from is recompiled because it was recorded."""

from __future__ import annotations

from typing import Any

from django.contrib.auth.models import AbstractBaseUser, AnonymousUser, User
from django.db import models

from federation.core.changes import change_recorded
from federation.core.models import AuditEvent

Actor = AbstractBaseUser | AnonymousUser | None


def _jsonable(value: Any) -> Any:
    if isinstance(value, models.Model):
        return value.pk
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set):
        return [_jsonable(v) for v in value]
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return str(value)


def audit_record(
    *,
    actor: Actor,
    action: str,
    obj: models.Model,
    changes: dict[str, Any] | None = None,
) -> AuditEvent:
    user = actor if actor is not None and actor.is_authenticated else None
    assert user is None or isinstance(user, User)
    event = AuditEvent.objects.create(
        actor=user,
        actor_repr=user.get_username() if user is not None else "system",
        action=action,
        object_type=obj._meta.label_lower,
        object_id=str(obj.pk),
        object_repr=str(obj)[:200],
        changes=_jsonable(changes or {}),
    )
    change_recorded(event)
    return event


def model_diff(obj: models.Model, data: dict[str, Any]) -> dict[str, list[Any]]:
    """``{field: [old, new]}`` for the fields in ``data`` whose value changes."""
    diff: dict[str, list[Any]] = {}
    for field, new in data.items():
        old = getattr(obj, field)
        if old != new:
            diff[field] = [_jsonable(old), _jsonable(new)]
    return diff
