"""One try of a request on an instance: the bookkeeping both hops of the edge share.

Used by the single-hop path (``forward.py``) and by both legs of a disaggregated request
(``disagg.py``), so that load, the in-flight gauge, health and the gateway's wake-ups stay one
mechanism.
"""

from __future__ import annotations

import time

from regions.edge.http.errors import UpstreamFailure
from regions.edge.stages.gateway_line import GatewayLines
from regions.edge.view.health import HealthBoard
from regions.edge.view.load import InstanceLoad, LoadBoard
from regions.tables.schema import Instance


class Attempts:
    """What every try touches: the instances' load and health, the in-flight gauge (instance
    → count) and the gateway lines waiting for a freed slot."""

    __slots__ = ("health", "inflight", "lines", "loads")

    def __init__(
        self, loads: LoadBoard, health: HealthBoard, inflight: dict[str, int], lines: GatewayLines
    ) -> None:
        self.loads = loads
        self.health = health
        self.inflight = inflight
        self.lines = lines


class Attempt:
    """One try of a request on an instance, as a ``with`` block.

    While it runs, the request counts in the instance's load (the scheduler sees it at once)
    and in-flight gauge; afterwards its service time feeds the load model (or, when it never
    reached the instance, it is simply released) and the next waiter for the freed slot wakes.
    """

    __slots__ = ("attempts", "inst", "load", "reached", "started")

    def __init__(
        self, attempts: Attempts, inst: Instance, prompt_tokens: int, uncached: int
    ) -> None:
        self.attempts = attempts
        self.inst = inst
        self.load: InstanceLoad = attempts.loads.get(inst.id)
        self.load.admit(uncached)
        self.load.tokens += prompt_tokens
        inflight = attempts.inflight
        inflight[inst.id] = inflight.get(inst.id, 0) + 1
        changed = attempts.loads.on_change
        if changed is not None:  # peer sync on: tell the other edges
            changed()
        #: The instance saw the request (its time counts as service time).
        self.reached = True
        self.started = 0.0

    def __enter__(self) -> Attempt:
        self.started = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.reached:
            self.load.finish(time.perf_counter() - self.started)
        else:
            self.load.release()
        attempts = self.attempts
        attempts.inflight[self.inst.id] -= 1
        changed = attempts.loads.on_change
        if changed is not None:
            changed()
        attempts.lines.wake(self.inst)

    def failed(self, failure: UpstreamFailure) -> None:
        """It failed before the first byte: count it against the instance's health."""
        self.reached = not failure.connect
        if failure.connect:
            self.attempts.health.connect_error(self.inst.id, failure.reason)
        else:
            self.attempts.health.failure(self.inst.id, failure.reason)
