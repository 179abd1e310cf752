"""Instance health with hysteresis: a pure state machine plus the async prober that feeds it.

One failed probe must not reshuffle the prefix caches of a whole fleet, so ejection takes
``eject_after`` consecutive failures (active probes or 5xx answers) and readmission takes
``readmit_after`` consecutive successful probes *and* the end of an exponential backoff. A
refused connection is different: the process is gone, so it ejects at once.
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
    failures: int = 0
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
        failures=state.failures,
        successes=0,
        ejections=state.ejections + 1,
        ejected_until=now + backoff,
        changed_at=now,
        reason=reason,
    )


def on_success(state: Health, now: float, cfg: HealthConfig) -> Health:
    """A probe answered 200 (or a request succeeded)."""
    if state.healthy:
        ejections = state.ejections
        if ejections and now - state.changed_at >= cfg.backoff_reset_s:
            ejections = 0
        if state.failures == 0 and ejections == state.ejections:
            return state
        return replace(state, failures=0, ejections=ejections)
    successes = state.successes + 1
    if successes >= cfg.readmit_after and now >= state.ejected_until:
        return Health(healthy=True, ejections=state.ejections, changed_at=now, reason="readmitted")
    return replace(state, successes=successes, failures=0)


def on_failure(state: Health, now: float, cfg: HealthConfig, reason: str) -> Health:
    """A probe failed or the instance answered 5xx: eject after ``eject_after`` in a row."""
    failures = state.failures + 1
    if state.healthy:
        if failures >= cfg.eject_after:
            return _eject(replace(state, failures=failures), now, cfg, reason)
        return replace(state, failures=failures)
    return replace(state, failures=failures, successes=0)


def on_connect_error(state: Health, now: float, cfg: HealthConfig, reason: str) -> Health:
    """The instance refused or dropped the connection: eject now (or stay out, longer)."""
    if state.healthy:
        return _eject(replace(state, failures=state.failures + 1), now, cfg, reason)
    return replace(state, failures=state.failures + 1, successes=0)


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

    def success(self, instance: str) -> None:
        state = self.states.get(instance)
        if state is not None:
            self._apply(instance, on_success(state, time.monotonic(), self.cfg))

    def failure(self, instance: str, reason: str) -> None:
        state = self.states.get(instance)
        if state is not None:
            self._apply(instance, on_failure(state, time.monotonic(), self.cfg, reason))

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
        board.failure(instance, f"probe failed: {exc.__class__.__name__}")
        return
    if resp.status_code == 200:
        board.success(instance)
    else:
        board.failure(instance, f"probe status {resp.status_code}")


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
