"""The gateway's lines (gateway_line.py): bounded, first come first served, per instance."""

from __future__ import annotations

import asyncio
import time

from prometheus_client import CollectorRegistry, Gauge

from regions.edge.stages.gateway_line import GatewayLines, blocked, line_key
from regions.tables.schema import Instance


def lines(queue_size: int = 8, registry: CollectorRegistry | None = None) -> GatewayLines:
    return GatewayLines(queue_size, Gauge("depth", "", registry=registry or CollectorRegistry()))


def test_each_role_of_a_model_has_its_own_line() -> None:
    assert line_key("llama", "mixed") == "llama"
    assert line_key("llama", "prefill") != line_key("llama", "mixed")


def test_the_gateway_is_bounded_and_counts_its_waiters() -> None:
    registry = CollectorRegistry()
    gateway = lines(queue_size=2, registry=registry)
    line = gateway.line("llama")
    first, second = gateway.join(line), gateway.join(line)
    assert first is not None and second is not None
    assert gateway.join(line) is None  # full
    assert gateway.queued == 2 and registry.get_sample_value("depth") == 2
    gateway.leave(line, first)
    assert gateway.queued == 1 and registry.get_sample_value("depth") == 1
    assert list(line) == [second]


def test_nobody_overtakes_an_earlier_waiter_for_the_same_instance() -> None:
    gateway = lines()
    line = gateway.line("llama")
    ahead, behind = gateway.join(line), gateway.join(line)
    assert ahead is not None and behind is not None
    ahead.target = "i-1"
    assert blocked(line, "i-1", None)  # an arrival would overtake ``ahead``
    assert blocked(line, "i-1", behind)
    assert not blocked(line, "i-2", behind)  # nobody ahead wants i-2
    assert not blocked(line, "i-1", ahead)  # the first in line


def test_a_freed_slot_wakes_the_first_waiter_that_wants_it() -> None:
    async def main() -> None:
        gateway = lines()
        line = gateway.line("llama")
        other, wanting = gateway.join(line), gateway.join(line)
        assert other is not None and wanting is not None
        waits = [
            asyncio.create_task(gateway.wait(line, other, "i-2", 5.0)),
            asyncio.create_task(gateway.wait(line, wanting, "i-1", 5.0)),
        ]
        await asyncio.sleep(0)
        assert gateway.targeted == {"i-2": 1, "i-1": 1}
        gateway.wake(Instance(id="i-1", url="http://127.0.0.1:9", model="llama"))
        assert wanting.freed == "i-1" and other.freed is None
        assert await waits[1] is True
        assert not waits[0].done()
        gateway.wake_all()
        assert await waits[0] is True

    asyncio.run(main())


def test_a_waiter_past_its_deadline_does_not_wait() -> None:
    async def main() -> None:
        gateway = lines()
        line = gateway.line("llama")
        waiter = gateway.join(line)
        assert waiter is not None
        assert await gateway.wait(line, waiter, "i-1", 0.0) is False
        gateway.leave(line, waiter)
        assert gateway.targeted == {"i-1": 0} and gateway.queued == 0

    asyncio.run(main())


def test_slots_freed_at_once_wake_as_many_waiters_as_wait_in_bounded_work() -> None:
    """A peer's slots freed together (peer sync): one call wakes that many waiters, never
    more, and the work is the line's length whatever the count (2**63 slots included)."""

    async def main() -> None:
        gateway = lines()
        line = gateway.line("llama")
        waiters = [gateway.join(line) for _ in range(4)]
        assert all(w is not None for w in waiters)
        waits = [asyncio.create_task(gateway.wait(line, w, "i-1", 5.0)) for w in waiters if w]
        await asyncio.sleep(0)
        inst = Instance(id="i-1", url="http://127.0.0.1:9", model="llama")
        gateway.wake(inst, 2)
        assert [w.freed for w in waiters if w] == ["i-1", "i-1", None, None]
        started = time.perf_counter()
        gateway.wake(inst, 2**63)
        assert time.perf_counter() - started < 0.01
        assert all(await asyncio.gather(*waits))

    asyncio.run(main())
