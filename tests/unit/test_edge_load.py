"""Live-load scrapes (``regions/edge/view/load.py``) and their own timeout."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import httpx

from regions.edge.cli import build_parser, config_from_args
from regions.edge.view.load import MAX_METRICS_BYTES, LoadBoard, scrape_loop, scrape_once
from regions.engines.metrics import EngineLoad

METRICS = """\
vllm:num_requests_running{engine="0",model_name="m"} 4.0
vllm:num_requests_waiting{engine="0",model_name="m"} 1.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
"""


def test_a_scrape_uses_its_own_timeout_not_the_probe_clients() -> None:
    seen: list[object] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.extensions["timeout"])
        return httpx.Response(200, text=METRICS)

    async def run() -> LoadBoard:
        board = LoadBoard(scrape_timeout_s=7.5)
        board.sync({"i-1": "m"})
        # The shared client carries the health probe's short timeout.
        async with httpx.AsyncClient(
            transport=httpx.MockTransport(handler), timeout=httpx.Timeout(1.0)
        ) as client:
            await scrape_once(client, board, "i-1", "http://engine")
        return board

    board = asyncio.run(run())
    assert seen == [{"connect": 7.5, "read": 7.5, "write": 7.5, "pool": 7.5}]
    engine = board.loads["i-1"].engine
    assert engine is not None and engine.num_requests_running == 4


def test_an_engines_metrics_past_the_bound_are_refused_unread_and_counted() -> None:
    """A broken or hostile engine answering an endless /metrics: the edge stops reading at
    MAX_METRICS_BYTES, takes no reading from it and counts the failed scrape."""
    sent = 0

    async def endless() -> AsyncIterator[bytes]:
        nonlocal sent
        yield METRICS.encode()
        line = b"# padding " + b"x" * 65_000 + b"\n"
        while True:
            sent += len(line)
            yield line

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=endless())

    errors: list[str] = []

    async def run() -> LoadBoard:
        board = LoadBoard()
        board.sync({"i-1": "m"})
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            await scrape_once(client, board, "i-1", "http://engine", errors.append)
        return board

    board = asyncio.run(run())
    assert errors == ["i-1"]
    assert board.loads["i-1"].engine is None
    assert MAX_METRICS_BYTES < sent < MAX_METRICS_BYTES + 2 * 65_011


def test_an_engine_trickling_its_metrics_is_cut_at_the_scrape_timeout() -> None:
    """httpx's read timeout is per read: a body trickled a byte at a time never hits it. The
    whole scrape has the scrape timeout."""

    async def trickle() -> AsyncIterator[bytes]:
        while True:
            await asyncio.sleep(0.01)
            yield b"#"

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=trickle())

    errors: list[str] = []

    async def run() -> float:
        board = LoadBoard(scrape_timeout_s=0.3)
        board.sync({"i-1": "m"})
        started = time.monotonic()
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            await scrape_once(client, board, "i-1", "http://engine", errors.append)
        return time.monotonic() - started

    took = asyncio.run(run())
    assert errors == ["i-1"]
    assert took < 2.0


def test_scrape_timeout_flag_is_separate_from_the_probe_timeout() -> None:
    args = ["--region", "r1", "--table", "t.json"]
    default = config_from_args(build_parser().parse_args(args))
    assert default.scrape_timeout_s == 2.0
    assert default.probe_timeout_s == 1.0
    cfg = config_from_args(build_parser().parse_args([*args, "--scrape-timeout", "10"]))
    assert cfg.scrape_timeout_s == 10.0
    assert cfg.probe_timeout_s == 1.0
    cfg = config_from_args(build_parser().parse_args([*args, "--probe-timeout", "4"]))
    assert (cfg.probe_timeout_s, cfg.scrape_timeout_s) == (4.0, 2.0)


def test_a_slow_engine_does_not_hold_back_the_other_engines_readings() -> None:
    """One engine answering /metrics late (a starved CPU server) delays only its own reading:
    the other engine is read every interval meanwhile."""
    scrapes = {"fast": 0, "slow": 0}

    async def handler(request: httpx.Request) -> httpx.Response:
        name = request.url.host
        scrapes[name] += 1
        if name == "slow":
            await asyncio.sleep(5.0)
        return httpx.Response(200, text=METRICS)

    async def run() -> None:
        board = LoadBoard(scrape_timeout_s=10.0)
        board.sync(dict.fromkeys(["fast", "slow"], "m"))
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            loop = asyncio.create_task(
                scrape_loop(
                    client, board, lambda: [("fast", "http://fast"), ("slow", "http://slow")], 0.05
                )
            )
            await asyncio.sleep(0.6)
            loop.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await loop

    asyncio.run(run())
    assert scrapes["slow"] == 1  # still waiting for its first answer
    assert scrapes["fast"] >= 8, scrapes


def test_an_engine_a_peer_read_recently_is_not_scraped_again_and_readings_are_shared() -> None:
    """Peer sync shares readings: while a peer's reading of an engine is fresh this edge does
    not scrape it (an engine answers one edge's scrapes, not one per edge); what this edge
    scrapes goes to its ``on_scraped`` hook."""
    scrapes = {"mine": 0, "theirs": 0}
    shared: list[tuple[str, int]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        scrapes[request.url.host] += 1
        return httpx.Response(200, text=METRICS)

    async def run() -> LoadBoard:
        board = LoadBoard()
        board.sync(dict.fromkeys(["mine", "theirs"], "m"))
        board.on_scraped = lambda inst, engine: shared.append((inst, engine.num_requests_running))
        targets = [("mine", "http://mine"), ("theirs", "http://theirs")]
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            loop = asyncio.create_task(scrape_loop(client, board, lambda: targets, 0.05))
            for _ in range(12):  # a peer reads "theirs" every 40 ms
                board.loads["theirs"].shared(EngineLoad(7, 0, 0.5), time.monotonic())
                await asyncio.sleep(0.04)
            loop.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await loop
        return board

    board = asyncio.run(run())
    assert scrapes["theirs"] == 0, scrapes
    assert scrapes["mine"] >= 7, scrapes
    assert shared and all(reading == ("mine", 4) for reading in shared)
    assert board.loads["theirs"].snapshot() == (7, 0, 0.5)
