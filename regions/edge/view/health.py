"""Instance health with hysteresis: a pure state machine plus the async prober that feeds it.

One failed probe must not reshuffle the prefix caches of a whole fleet, so ejection takes
``eject_after`` consecutive failures (active probes or 5xx answers) and readmission takes
``readmit_after`` consecutive successful probes *and* the end of an exponential backoff; until
the backoff resets after a quiet period, one more failure ejects again. A refused connection is
different: the process is gone, so it ejects at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import httpx

log = logging.getLogger("fedinfer.edge.health")


@dataclass(frozen=True, slots=True)
class HealthConfig:
    eject_after: int = 3
    readmit_after: int = 2
    backoff_base_s: float = 1.0
    backoff_max_s: float = 30.0
    #: A readmitted instance that stays up this long has its backoff reset.
    backoff_reset_s: float = 60.0


@dataclass(frozen=True, slots=True)
class Health:
    healthy: bool = True
    #: Consecutive failed active probes.
    probe_failures: int = 0
    #: Consecutive failed requests (5xx); counted apart, since a server can pass its probes
    #: and still fail requests, and a passing probe must not hide that.
    request_failures: int = 0
    #: Consecutive successful probes while ejected.
    successes: int = 0
    #: Consecutive ejections without a quiet period in between (drives the backoff).
    ejections: int = 0
    ejected_until: float = 0.0
    changed_at: float = 0.0
    reason: str = ""


def _eject(state: Health, now: float, cfg: HealthConfig, reason: str) -> Health:
    backoff = min(cfg.backoff_max_s, cfg.backoff_base_s * (2**state.ejections))
    return Health(
        healthy=False,
        ejections=state.ejections + 1,
        ejected_until=now + backoff,
        changed_at=now,
        reason=reason,
    )


def _quiet(state: Health, now: float, cfg: HealthConfig) -> int:
    """Ejection count, forgotten once the instance has stayed admitted ``backoff_reset_s``."""
    if state.ejections and now - state.changed_at >= cfg.backoff_reset_s:
        return 0
    return state.ejections


def on_success(state: Health, now: float, cfg: HealthConfig, probe: bool = True) -> Health:
    """A probe answered 200 (``probe``) or a request succeeded."""
    if state.healthy:
        ejections = _quiet(state, now, cfg)
        if probe:
            if state.probe_failures == 0 and ejections == state.ejections:
                return state
            return replace(state, probe_failures=0, ejections=ejections)
        if state.request_failures == 0 and ejections == state.ejections:
            return state
        return replace(state, request_failures=0, ejections=ejections)
    if not probe:
        return state  # a request that was already in flight when the instance was ejected
    successes = state.successes + 1
    if successes >= cfg.readmit_after and now >= state.ejected_until:
        return Health(healthy=True, ejections=state.ejections, changed_at=now, reason="readmitted")
    return replace(state, successes=successes)


def on_failure(
    state: Health, now: float, cfg: HealthConfig, reason: str, probe: bool = True
) -> Health:
    """A probe failed, or a request got 5xx: eject after ``eject_after`` in a row.

    A readmitted instance is on probation until its backoff resets: one failure ejects it again
    (for twice as long), so a server that passes probes but fails requests cannot flap back in
    at full weight.
    """
    if not state.healthy:
        return replace(state, successes=0) if probe else state
    if probe:
        state = replace(state, probe_failures=state.probe_failures + 1)
        count = state.probe_failures
    else:
        state = replace(state, request_failures=state.request_failures + 1)
        count = state.request_failures
    if count >= cfg.eject_after or _quiet(state, now, cfg) > 0:
        return _eject(state, now, cfg, reason)
    return state


def on_connect_error(state: Health, now: float, cfg: HealthConfig, reason: str) -> Health:
    """The instance refused or dropped the connection: eject now (or restart probation)."""
    if state.healthy:
        return _eject(state, now, cfg, reason)
    return replace(state, successes=0)


class HealthBoard:
    """The mutable registry the shell holds: instance id → :class:`Health`, with callbacks."""

    def __init__(
        self, cfg: HealthConfig, on_eject: Callable[[str, str], None] | None = None
    ) -> None:
        self.cfg = cfg
        self.states: dict[str, Health] = {}
        self._on_eject = on_eject

    def sync(self, ids: list[str]) -> None:
        """Track exactly ``ids`` (after a table change); new instances start healthy."""
        now = time.monotonic()
        self.states = {i: self.states.get(i) or Health(changed_at=now) for i in ids}

    def is_healthy(self, instance: str) -> bool:
        state = self.states.get(instance)
        return state is not None and state.healthy

    def _apply(self, instance: str, new: Health) -> None:
        old = self.states.get(instance)
        if old is None:
            return
        self.states[instance] = new
        if old.healthy and not new.healthy:
            log.warning("instance %s ejected: %s", instance, new.reason)
            if self._on_eject is not None:
                self._on_eject(instance, new.reason)
        elif new.healthy and not old.healthy:
            log.info("instance %s readmitted", instance)

    def success(self, instance: str, probe: bool = False) -> None:
        state = self.states.get(instance)
        if state is not None:
            self._apply(instance, on_success(state, time.monotonic(), self.cfg, probe))

    def failure(self, instance: str, reason: str, probe: bool = False) -> None:
        state = self.states.get(instance)
        if state is not None:
            self._apply(instance, on_failure(state, time.monotonic(), self.cfg, reason, probe))

    def connect_error(self, instance: str, reason: str) -> None:
        state = self.states.get(instance)
        if state is not None:
            self._apply(instance, on_connect_error(state, time.monotonic(), self.cfg, reason))


async def probe_once(
    client: httpx.AsyncClient, board: HealthBoard, instance: str, url: str
) -> None:
    """One ``GET /health``; its outcome goes into the state machine."""
    try:
        resp = await client.get(url + "/health")
    except httpx.ConnectError as exc:
        board.connect_error(instance, f"probe connect error: {exc.__class__.__name__}")
        return
    except httpx.HTTPError as exc:
        board.failure(instance, f"probe failed: {exc.__class__.__name__}", probe=True)
        return
    if resp.status_code == 200:
        board.success(instance, probe=True)
    else:
        board.failure(instance, f"probe status {resp.status_code}", probe=True)


async def probe_loop(
    client: httpx.AsyncClient,
    board: HealthBoard,
    targets: Callable[[], list[tuple[str, str]]],
    interval_s: float,
) -> None:
    """Probe every instance of the current table every ``interval_s`` until cancelled."""
    while True:
        started = time.monotonic()
        pairs = targets()
        if pairs:
            await asyncio.gather(*(probe_once(client, board, i, u) for i, u in pairs))
        await asyncio.sleep(max(0.0, interval_s - (time.monotonic() - started)))
