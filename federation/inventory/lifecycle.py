"""The legal lifecycle of an engine instance. Pure: states are the strings of Instance.State.

    pending ─▶ loading ─▶ warming ─▶ ready ⇄ draining
       ▲          any live state ─▶ failed | stopped
       └──────── stopped, failed (restart)

Only these moves are allowed so that the routing tables, which route to ``ready`` instances
only, never see an engine jump from ``stopped`` straight to serving without loading its weights.
"""

from __future__ import annotations

from federation.core.errors import Conflict

PENDING = "pending"
LOADING = "loading"
WARMING = "warming"
READY = "ready"
DRAINING = "draining"
STOPPED = "stopped"
FAILED = "failed"

TRANSITIONS: dict[str, frozenset[str]] = {
    PENDING: frozenset({LOADING, FAILED, STOPPED}),
    LOADING: frozenset({WARMING, FAILED, STOPPED}),
    WARMING: frozenset({READY, FAILED, STOPPED}),
    READY: frozenset({DRAINING, FAILED, STOPPED}),
    DRAINING: frozenset({READY, STOPPED, FAILED}),
    STOPPED: frozenset({PENDING}),
    FAILED: frozenset({PENDING, STOPPED}),
}

# States that hold GPUs (count against a deployment's max_replicas).
LIVE_STATES = frozenset({PENDING, LOADING, WARMING, READY, DRAINING})
# States in which an instance holds its GPUs (its cost runs): from loading the weights until
# it stops or fails. A pending instance has been asked for but holds none yet.
GPU_STATES = frozenset({LOADING, WARMING, READY, DRAINING})
# States in which an instance may be deleted: it holds no GPU and serves nothing.
TERMINAL_STATES = frozenset({STOPPED, FAILED})

ORDER = (PENDING, LOADING, WARMING, READY, DRAINING, STOPPED, FAILED)


def allowed_targets(state: str) -> list[str]:
    """The states reachable from ``state`` in one step, in lifecycle order."""
    targets = TRANSITIONS.get(state, frozenset())
    return [s for s in ORDER if s in targets]


def is_legal(source: str, target: str) -> bool:
    return target in TRANSITIONS.get(source, frozenset())


def check_transition(source: str, target: str) -> None:
    """Raise Conflict (HTTP 409) unless ``source → target`` is a legal move."""
    if source not in TRANSITIONS:
        raise Conflict(f"Unknown instance state {source!r}.", code="illegal_transition")
    if target not in TRANSITIONS:
        raise Conflict(
            f"Unknown target state {target!r}; states are {', '.join(ORDER)}.",
            code="illegal_transition",
        )
    if not is_legal(source, target):
        raise Conflict(
            f"An instance in state '{source}' cannot move to '{target}'; "
            f"allowed from '{source}': {', '.join(allowed_targets(source))}.",
            code="illegal_transition",
        )
