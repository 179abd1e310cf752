"""One try of a request on an instance: the bookkeeping both hops of the edge share.

Used by the single-hop path (app.py) and by both legs of a disaggregated request (disagg.py),
so that load, the in-flight gauge, health and the gateway's wake-ups stay one mechanism.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from regions.edge.errors import UpstreamFailure

if TYPE_CHECKING:
    from regions.edge.app import Edge
    from regions.tables.schema import Instance


class Attempt:
    """One try of a request on an instance, as a ``with`` block.

    While it runs, the request counts in the instance's load (the scheduler sees it at once)
    and in-flight gauge; afterwards its service time feeds the load model (or, when it never
    reached the instance, it is simply released) and the next waiter for the freed slot wakes.
    """

    __slots__ = ("edge", "inst", "load", "reached", "started")

    def __init__(self, edge: Edge, inst: Instance, prompt_tokens: int, uncached: int) -> None:
        self.edge = edge
        self.inst = inst
        self.load = load = edge.loads.get(inst.id)
        load.admit(uncached)
        load.tokens += prompt_tokens
        inflight = edge.metrics.inflight
        inflight[inst.id] = inflight.get(inst.id, 0) + 1
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
        self.edge.metrics.inflight[self.inst.id] -= 1
        self.edge._wake(self.inst)

    def failed(self, failure: UpstreamFailure) -> None:
        """It failed before the first byte: count it against the instance's health."""
        self.reached = not failure.connect
        if failure.connect:
            self.edge.health.connect_error(self.inst.id, failure.reason)
        else:
            self.edge.health.failure(self.inst.id, failure.reason)
