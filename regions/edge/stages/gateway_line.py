"""The queue stage: requests wait at the gateway, in line, while their instance has no slot.

One line per model (or adapter) name and instance role, first come first served, bounded in
total (``queue_size``). A waiter targets the instance it chose (or any instance of the model,
for the hard-cap policies) and re-decides when a slot of its target frees, or every 50 ms.
Nobody takes a slot ahead of an earlier waiter for the same instance (or for any instance), so
a sustained load cannot starve the line into timeouts (:meth:`GatewayLines.blocked`). The
decisions themselves are ``place.py``'s.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque

from prometheus_client import Gauge

from regions.tables.schema import Instance

#: How long a waiter sleeps at most before it re-decides (load shifts without a freed slot).
POLL_S = 0.05


class Waiter:
    """A request waiting at the gateway; stays in its line until it has decided."""

    __slots__ = ("freed", "fut", "target")

    def __init__(self) -> None:
        self.fut: asyncio.Future[None] | None = None
        #: The instance it waits for (None: any instance of the model).
        self.target: str | None = None
        #: The instance whose freed slot woke it.
        self.freed: str | None = None


Line = deque[Waiter]


def line_key(model: str, role: str) -> str:
    """The gateway line of a model (or adapter) name for instances of ``role``."""
    return model if role == "mixed" else f"{model}\0{role}"


def blocked(line: Line, inst_id: str, me: Waiter | None) -> bool:
    """Would taking a slot of ``inst_id`` now overtake someone ahead waiting for it?"""
    for w in line:
        if w is me:
            return False
        if w.target is None or w.target == inst_id:
            return True
    return False


class GatewayLines:
    """Every line of the gateway, with how many wait in all and for each instance."""

    __slots__ = ("_lines", "depth", "queue_size", "queued", "targeted")

    def __init__(self, queue_size: int, depth: Gauge) -> None:
        self.queue_size = queue_size
        #: The ``fedinfer_edge_queue_depth`` gauge, kept equal to :attr:`queued`.
        self.depth = depth
        self.queued = 0
        #: Instance → waiters targeting it (the scheduler counts them as queued there).
        self.targeted: dict[str, int] = {}
        self._lines: dict[str, Line] = {}

    def line(self, key: str) -> Line:
        line = self._lines.get(key)
        if line is None:
            line = self._lines[key] = deque()
        return line

    def join(self, line: Line) -> Waiter | None:
        """A new waiter at the end of ``line``; None when the gateway is full."""
        if self.queued >= self.queue_size:
            return None
        waiter = Waiter()
        line.append(waiter)
        self.queued += 1
        self.depth.inc()
        return waiter

    async def wait(self, line: Line, waiter: Waiter, target: str | None, remaining: float) -> bool:
        """Wait for a slot of ``target`` (None: any), at most ``POLL_S``; False when the
        ``remaining`` time is up instead."""
        if waiter.freed is not None:
            # Woken for a slot this waiter did not take: hand it to the next in line.
            self._wake_in(line, waiter.freed, after=waiter)
        self._retarget(waiter, target)
        if remaining <= 0:
            return False
        waiter.fut = asyncio.get_running_loop().create_future()
        waiter.freed = None
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(min(remaining, POLL_S)):
                await waiter.fut
        return True

    def leave(self, line: Line, waiter: Waiter) -> None:
        line.remove(waiter)
        self._retarget(waiter, None)
        self.queued -= 1
        self.depth.dec()

    def wake(self, inst: Instance, slots: int = 1) -> None:
        """``slots`` slots of ``inst`` freed: wake the first waiters that want one, at most
        ``slots`` of them (and never more than wait: the work is bounded by the line, not by
        ``slots``)."""
        for name in (inst.model, *inst.adapters):
            line = self._lines.get(line_key(name, inst.role))
            if not line:
                continue
            for waiter in line:
                if slots <= 0:
                    return
                if self._wakes(waiter, inst.id):
                    slots -= 1

    def wake_all(self) -> None:
        """The table changed: everyone re-decides."""
        for line in self._lines.values():
            for waiter in line:
                if waiter.fut is not None and not waiter.fut.done():
                    waiter.fut.set_result(None)

    def _retarget(self, waiter: Waiter, target: str | None) -> None:
        counts = self.targeted
        if waiter.target is not None:
            counts[waiter.target] -= 1
        waiter.target = target
        if target is not None:
            counts[target] = counts.get(target, 0) + 1

    def _wake_in(self, line: Line, inst_id: str, after: Waiter | None) -> bool:
        passed = after is None
        for waiter in line:
            if not passed:
                passed = waiter is after
                continue
            if self._wakes(waiter, inst_id):
                return True
        return False

    @staticmethod
    def _wakes(waiter: Waiter, inst_id: str) -> bool:
        """Wake ``waiter`` for a freed slot of ``inst_id`` if it waits for one."""
        fut = waiter.fut
        if (
            (waiter.target is None or waiter.target == inst_id)
            and fut is not None
            and not fut.done()
        ):
            waiter.freed = inst_id
            fut.set_result(None)
            return True
        return False
