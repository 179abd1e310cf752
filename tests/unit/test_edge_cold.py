"""Holding requests for a model scaled to zero (regions/edge/stages/cold.py): bounded in count and
time, released in arrival order, a client that leaves leaves the line, demand reported."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Coroutine
from typing import Any

import pytest

from regions.edge.http.errors import EdgeError
from regions.edge.stages.cold import ColdConfig, ColdHolds, Released, make_room
from regions.tables.schema import ColdModel, RoutingTable

COLD = RoutingTable(
    schema_version=5,
    version=1,
    region="eu-west",
    generated_at="x",
    cold_models=(ColdModel("qwen", adapters=("qwen-fr",), cold_start_s=0.5),),
)
WARM = RoutingTable(schema_version=1, version=2, region="eu-west", generated_at="x")


def sync(test: Callable[[], Coroutine[Any, Any, None]]) -> Callable[[], None]:
    """Run an async test on its own event loop (the project's tests use no asyncio plugin)."""

    @functools.wraps(test)
    def run() -> None:
        asyncio.run(test())

    return run


def holds(
    max_held: int = 4, max_hold_s: float = 10.0, margin_s: float = 0.0
) -> tuple[ColdHolds, list[int]]:
    nudges: list[int] = []
    cold = ColdHolds(ColdConfig(max_held, max_hold_s, margin_s), on_demand=lambda: nudges.append(1))
    cold.load(COLD)
    return cold, nudges


@sync
async def test_held_requests_are_released_in_arrival_order_when_the_model_is_served() -> None:
    cold, nudges = holds()
    done: list[int] = []

    async def one(n: int) -> None:
        cold.arrived("qwen", 0.0)
        await cold.hold("qwen")
        done.append(n)

    tasks = [asyncio.create_task(one(n)) for n in range(3)]
    await asyncio.sleep(0.01)
    assert cold.held("qwen") == 3 and nudges == [1]  # one early heartbeat, not one per request
    assert cold.report() == [{"model": "qwen", "held": 3, "arrived": 3}]
    assert cold.report() == [{"model": "qwen", "held": 3, "arrived": 0}]
    cold.load(WARM)
    cold.release({"qwen"})
    await asyncio.gather(*tasks)
    assert done == [0, 1, 2] and cold.held("qwen") == 0


@sync
async def test_the_line_is_bounded_in_count_and_time_with_a_retry_after() -> None:
    cold, _ = holds(max_held=2, max_hold_s=0.2)
    cold.arrived("qwen", 0.0)
    waiting = [asyncio.create_task(cold.hold("qwen")) for _ in range(2)]
    await asyncio.sleep(0.01)
    with pytest.raises(EdgeError) as full:
        await cold.hold("qwen")
    assert full.value.status == 503 and full.value.code == "model_cold"
    assert full.value.retry_after is not None and full.value.retry_after >= 1
    for task in waiting:  # held for the edge's maximum, not the table's longer cold start
        with pytest.raises(EdgeError, match=r"not ready within 0\.2 s"):
            await task
    assert cold.held("qwen") == 0


@sync
async def test_the_tables_cold_start_and_the_margin_bound_the_hold_when_shorter() -> None:
    cold, _ = holds(max_hold_s=60.0, margin_s=0.3)
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(EdgeError, match="is starting"):
        await cold.hold("qwen-fr")  # an adapter of the cold model: held the same way
    assert 0.75 < loop.time() - started < 2.0


@sync
async def test_a_client_that_leaves_leaves_the_line() -> None:
    cold, _ = holds()
    first = asyncio.create_task(cold.hold("qwen"))
    second = asyncio.create_task(cold.hold("qwen"))
    await asyncio.sleep(0.01)
    first.cancel()
    await asyncio.sleep(0.01)
    assert cold.held("qwen") == 1
    cold.load(WARM)
    cold.release({"qwen"})
    assert await second >= 0.0
    assert first.cancelled()


@sync
async def test_a_model_that_left_the_table_is_released_as_gone() -> None:
    cold, _ = holds()
    task = asyncio.create_task(cold.hold("qwen"))
    await asyncio.sleep(0.01)
    cold.load(WARM)
    cold.release(set())
    with pytest.raises(Released):
        await task


def test_reports_group_adapters_under_their_model_and_forget_quiet_ones() -> None:
    cold, nudges = holds()
    cold.arrived("qwen-fr", 5.0)
    cold.arrived("qwen", 6.0)
    assert nudges == [1, 1]  # each served name's first request beats at once
    assert cold.retry_after("qwen-fr", 5.2) == 1
    assert cold.report() == [{"model": "qwen", "held": 0, "arrived": 2}]
    assert cold.report() == []
    cold.arrived("qwen", 100.0)
    assert nudges == [1, 1, 1]  # after a quiet period the first request beats again


@pytest.mark.parametrize(
    ("held", "tenant", "capacity", "gives_way"),
    [
        ({"a": 4}, "b", 4, "a"),  # a flood gives way to a newcomer (share 2 each)
        ({"a": 2, "b": 2}, "b", 4, None),  # b has its share already
        ({"a": 2, "b": 2}, "c", 4, "b"),  # shares of 1 now: the most held (ties: by name)
        ({"a": 3, "b": 1}, "b", 4, "a"),
        ({"a": 1, "b": 1, "c": 1, "d": 1}, "e", 4, None),  # more tenants than places
        ({"": 4}, "", 4, None),  # one tenant (admission off): the plain bound
    ],
)
def test_a_full_line_makes_room_only_for_a_tenant_below_its_share(
    held: dict[str, int], tenant: str, capacity: int, gives_way: str | None
) -> None:
    assert make_room(held, tenant, capacity) == gives_way


@sync
async def test_one_tenant_flooding_the_line_never_refuses_another() -> None:
    """Tenant a fills the line alone; b's request is held all the same (a's newest gives way
    with 503 ``model_cold``), and a cannot take its place back."""
    cold, _ = holds(max_held=4)
    flood = [asyncio.create_task(cold.hold("qwen", "a")) for _ in range(4)]
    await asyncio.sleep(0.01)
    assert cold.held("qwen") == 4
    other = asyncio.create_task(cold.hold("qwen", "b"))
    await asyncio.sleep(0.01)
    with pytest.raises(EdgeError, match="shared by its tenants") as gave_way:
        await flood[-1]
    assert (gave_way.value.status, gave_way.value.code) == (503, "model_cold")
    assert cold.held("qwen") == 4 and not other.done()
    with pytest.raises(EdgeError, match="already waiting"):  # a holds 3, over its share of 2
        await cold.hold("qwen", "a")
    second = asyncio.create_task(cold.hold("qwen", "b"))  # b below its share: a gives way again
    await asyncio.sleep(0.01)
    with pytest.raises(EdgeError, match="shared by its tenants"):
        await flood[-2]
    with pytest.raises(EdgeError, match="already waiting"):  # b has its share too
        await cold.hold("qwen", "b")
    cold.load(WARM)
    cold.release({"qwen"})
    assert all(t >= 0.0 for t in await asyncio.gather(*flood[:2], other, second))
    assert cold.held("qwen") == 0
