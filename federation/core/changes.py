"""The one path from a recorded change to the routing tables: what routing schedules when
something a table compiles from changes.

Every service that changes a table's inputs (inventory's, tenancy's, and the fleet's, which
writes through inventory's) records the change with ``audit.audit_record`` in its transaction,
and ``audit_record`` then calls ``change_recorded`` here with the event. Usage ingestion that
counted a budgeted tenant's spend (metering's edge endpoint) calls ``budget_spend_counted``.
What either means for the tables is routing's to decide (a debounced recompile after commit,
an immediate publish of a change that takes access away, a spaced budget re-lease), but routing
sits above every domain that calls these (``pyproject.toml``'s layers), so they cannot import
it. Routing hands its scheduler over instead, once, as Django starts
(``RoutingConfig.ready`` → ``table_scheduler_set``).

Not a signal: one slot holding one typed scheduler, two named calls made explicitly by their
callers, synchronously (routing defers its own work with ``transaction.on_commit``). Without a
scheduler (a process that never loaded routing) a change schedules nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from federation.core.models import AuditEvent


@dataclass(frozen=True, slots=True)
class TableScheduler:
    """What routing does when a table's inputs change (``federation.routing.services``)."""

    #: Called with every audit event, inside the transaction that recorded it.
    change_recorded: Callable[[AuditEvent], None]
    #: Called after usage ingestion counted a budgeted tenant's spend; True if it queued work.
    budget_spend_counted: Callable[[], bool]


_scheduler: TableScheduler | None = None


def table_scheduler_set(scheduler: TableScheduler | None) -> TableScheduler | None:
    """Make ``scheduler`` the one that changes are handed to (None: none); returns the one it
    replaces. There is a single slot: setting it again replaces, never adds."""
    global _scheduler
    previous, _scheduler = _scheduler, scheduler
    return previous


def table_scheduler() -> TableScheduler | None:
    """The scheduler changes are handed to, if one is set."""
    return _scheduler


def change_recorded(event: AuditEvent) -> None:
    """A service recorded ``event`` (``audit_record``): let routing schedule what it needs."""
    if _scheduler is not None:
        _scheduler.change_recorded(event)


def budget_spend_counted() -> bool:
    """Ingestion counted a budgeted tenant's spend: let routing re-lease the budgets (spaced).
    True if a recompile was queued."""
    return _scheduler.budget_spend_counted() if _scheduler is not None else False
