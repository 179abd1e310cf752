"""The demo's traffic generator: a few requests per second from tenants of different
jurisdictions, each to an edge in a region it may use, streaming and not.

With ``--day-minutes N`` the traffic follows a day compressed into N minutes: each region's rate
peaks at its local afternoon (``--rps`` is that peak) and falls to a tenth of it at night, so the
autoscaler has something to follow — replicas come up as a region's afternoon arrives and go
once it has passed. Without it (``--day-minutes 0``) the rate is flat: ``--rps`` in all, tenants
in turn.

It exists so that ``fedinfer demo`` shows the federation moving: every ``--summary-every``
answers it prints one line — status counts, and per tenant which region served it (from
``x-fedinfer-route``; ``eu-west>us-east`` means sent to the eu-west edge, served in us-east;
``eu-west:503`` means refused there with that status).
Evacuate a region through the API and the next lines show its traffic elsewhere (or refused,
for a tenant with nowhere else to go).

No Django: it reads ``var/demo/endpoints.json`` (edges, this run's API keys, each tenant's
permitted regions) that the demo writes, and talks to the edges over HTTP like any client.
Seeded, so two runs send the same sequence of requests.

    python -m federation.demo.traffic --endpoints var/demo/endpoints.json
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import random
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
#: The local hour at which a region's traffic peaks, and its share of the peak at night.
PEAK_LOCAL_HOUR = 15.0
NIGHT_SHARE = 0.1
#: Seconds between two looks at the day's curve.
TICK_S = 0.05
PROMPTS = (
    "Summarise our refund policy in one sentence.",
    "Translate 'good morning' into French.",
    "Write a SQL query that counts orders per day.",
    "What is the capital of Australia?",
    "Give me three names for a coffee shop.",
)


@dataclass(frozen=True, slots=True)
class Client:
    """One tenant's client: its key and the edges (by region) it sends to."""

    tenant: str
    key: str
    edges: tuple[tuple[str, str], ...]  # (region code, edge URL)


@dataclass(slots=True)
class Window:
    """Answers since the last summary line."""

    started: float = field(default_factory=time.monotonic)
    #: The simulated UTC hour when the window closed (daily pattern only).
    hour: float | None = None
    total: int = 0
    streamed: int = 0
    statuses: Counter[str] = field(default_factory=Counter)
    served: dict[str, Counter[str]] = field(default_factory=dict)

    def add(self, tenant: str, stream: bool, status: str, path: str) -> None:
        self.total += 1
        self.streamed += stream
        self.statuses[status] += 1
        self.served.setdefault(tenant, Counter())[path] += 1

    def line(self) -> str:
        """One line, e.g. ``traffic 20 req (9 streamed) in 5.0s | 200=18 503=2 | globex-eu
        eu-west=3,eu-west:503=2 | initech eu-west>us-east=2,us-east=3``."""
        statuses = " ".join(f"{s}={n}" for s, n in sorted(self.statuses.items()))
        tenants = " | ".join(
            f"{tenant} " + ",".join(f"{p}={n}" for p, n in sorted(paths.items()))
            for tenant, paths in sorted(self.served.items())
        )
        elapsed = time.monotonic() - self.started
        clock = "" if self.hour is None else f" at {_clock(self.hour)} UTC"
        return (
            f"traffic {self.total} req ({self.streamed} streamed) in {elapsed:.1f}s{clock}"
            f" | {statuses} | {tenants}"
        )


def _clock(hour: float) -> str:
    minutes = int(hour * 60) % (24 * 60)
    return f"{minutes // 60:02d}:{minutes % 60:02d}"


@dataclass(frozen=True, slots=True)
class Day:
    """A simulated day: ``minutes`` of wall-clock time per 24 hours, starting at
    ``start_hour`` (UTC) when the generator starts."""

    minutes: float
    start_hour: float

    def hour(self, elapsed_s: float) -> float:
        """The simulated UTC hour (0..24) ``elapsed_s`` seconds after the start."""
        return (self.start_hour + elapsed_s / 60.0 / self.minutes * 24.0) % 24.0


def day_share(utc_hour: float, utc_offset_h: float) -> float:
    """A region's share of its peak rate at ``utc_hour``: 1 at its local afternoon, falling
    smoothly to ``NIGHT_SHARE`` twelve hours away (a raised cosine, cubed: a busy afternoon
    and a long quiet night, the shape of a business day's inference traffic)."""
    local = (utc_hour + utc_offset_h) % 24.0
    wave = (1.0 + math.cos(2.0 * math.pi * (local - PEAK_LOCAL_HOUR) / 24.0)) / 2.0
    return NIGHT_SHARE + (1.0 - NIGHT_SHARE) * wave**3


def region_clients(clients: list[Client]) -> dict[str, list[tuple[Client, str]]]:
    """For each region with an edge, the clients that may send there (with that edge's URL)."""
    out: dict[str, list[tuple[Client, str]]] = {}
    for client in clients:
        for region, url in client.edges:
            out.setdefault(region, []).append((client, url))
    return out


def route_region(header: str) -> str:
    """The region that served (or refused) a request, from its ``x-fedinfer-route``."""
    for part in header.split(";"):
        name, _, value = part.partition("=")
        if name == "region":
            return value
    return "?"


def clients_from(endpoints: dict[str, Any]) -> list[Client]:
    """A client per tenant of the demo, sending to the edges of its permitted regions."""
    edges: dict[str, str] = endpoints["edges"]
    clients = []
    for tenant, info in sorted(endpoints["tenants"].items()):
        regions = [code for code in info["regions"] if code in edges]
        if not regions:
            raise ValueError(f"tenant {tenant} may use none of the demo's regions")
        clients.append(
            Client(
                tenant=tenant,
                key=endpoints["api_keys"][tenant],
                edges=tuple((code, edges[code]) for code in regions),
            )
        )
    return clients


class Tally:
    """Counts answers into windows; prints a line and starts a new window every N answers."""

    def __init__(self, summary_every: int, clock: Callable[[], float | None]) -> None:
        self.summary_every = summary_every
        self.clock = clock
        self.window = Window()

    def record(self, tenant: str, stream: bool, status: str, path: str) -> None:
        self.window.add(tenant, stream, status, path)
        if self.window.total >= self.summary_every:
            self.window.hour = self.clock()
            print(self.window.line(), flush=True)
            self.window = Window()


async def one_request(
    http: httpx.AsyncClient,
    client: Client,
    edge: tuple[str, str],
    rng: random.Random,
    tally: Tally,
    max_tokens: tuple[int, int],
) -> None:
    """Send one chat completion to ``edge`` (region, URL) and record how it was answered and
    where."""
    region, url = edge
    stream = rng.random() < 0.5
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": rng.choice(PROMPTS)}],
        "max_tokens": rng.randint(*max_tokens),
        "stream": stream,
    }
    headers = {"Authorization": f"Bearer {client.key}"}
    try:
        async with http.stream(
            "POST", f"{url}/v1/chat/completions", json=body, headers=headers
        ) as resp:
            data = b"".join([chunk async for chunk in resp.aiter_bytes()])
            served = route_region(resp.headers.get("x-fedinfer-route", ""))
            status = str(resp.status_code)
            if resp.status_code == 200 and stream and b"data: [DONE]" not in data:
                status = "200-truncated"
    except httpx.HTTPError as exc:
        served, status = "?", exc.__class__.__name__
    path = served if served == region else f"{region}>{served}"
    tally.record(client.tenant, stream, status, path if status == "200" else f"{path}:{status}")


async def run(
    endpoints: dict[str, Any], *, rps: float, summary_every: int, seed: int, day: Day | None
) -> None:
    """Until cancelled: with ``day``, each region's edges get ``rps`` times its
    :func:`day_share` requests per second from the tenants that may use it; without, ``rps``
    requests per second in all, tenants in turn (each stays under its rate limit)."""
    clients = clients_from(endpoints)
    rng = random.Random(seed)
    pending: set[asyncio.Task[None]] = set()
    loop = asyncio.get_running_loop()
    started = loop.time()

    def clock() -> float | None:
        return None if day is None else day.hour(loop.time() - started)

    tally = Tally(summary_every, clock)

    def send(client: Client, edge: tuple[str, str], max_tokens: tuple[int, int]) -> None:
        task = asyncio.create_task(one_request(http, client, edge, rng, tally, max_tokens))
        pending.add(task)  # the loop holds only weak references to tasks
        task.add_done_callback(pending.discard)

    async with httpx.AsyncClient(timeout=httpx.Timeout(30.0, connect=2.0)) as http:
        if day is None:
            for n, client in enumerate(itertools.cycle(clients)):
                # Paced from the start: a slow answer does not lower the rate.
                await asyncio.sleep(max(0.0, started + n / rps - loop.time()))
                send(client, rng.choice(client.edges), (8, 32))
            return
        offsets: dict[str, float] = endpoints["utc_offsets"]

        async def region_loop(region: str, senders: list[tuple[Client, str]]) -> None:
            # Requests accrue at the day's rate and leave on the next tick: paced by the clock,
            # so a slow answer does not lower the rate, and a rising rate is felt at once.
            owed, last = 0.0, loop.time()
            while True:
                await asyncio.sleep(TICK_S)
                now = loop.time()
                owed += rps * day_share(day.hour(now - started), offsets[region]) * (now - last)
                last = now
                while owed >= 1.0:
                    owed -= 1.0
                    client, url = rng.choice(senders)
                    # Longer answers than the flat traffic's: a few requests per second then
                    # keep a replica's slots busy at a region's peak.
                    send(client, (region, url), (64, 192))

        await asyncio.gather(
            *(region_loop(r, senders) for r, senders in sorted(region_clients(clients).items()))
        )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="demo_traffic", description=__doc__.split("\n\n")[0])
    parser.add_argument("--endpoints", type=Path, required=True, help="the demo's endpoints.json")
    parser.add_argument(
        "--rps",
        type=float,
        default=4.0,
        help="requests per second: each region's at its peak (with --day-minutes), else in all",
    )
    parser.add_argument(
        "--day-minutes",
        type=float,
        default=0.0,
        help="minutes per simulated day: each region's traffic peaks at its local afternoon "
        "(0: a flat rate)",
    )
    parser.add_argument(
        "--day-start-hour",
        type=float,
        default=None,
        help="the simulated UTC hour at start (default: the time of day now)",
    )
    parser.add_argument("--summary-every", type=int, default=20, help="answers per summary line")
    parser.add_argument("--seed", type=int, default=1)
    opts = parser.parse_args(argv)
    if opts.rps <= 0 or opts.summary_every < 1 or opts.day_minutes < 0:
        parser.error("--rps must be > 0, --summary-every >= 1 and --day-minutes >= 0")
    endpoints = json.loads(opts.endpoints.read_text())
    day = None
    pattern = f"{opts.rps:g} req/s"
    if opts.day_minutes > 0:
        now = time.gmtime()
        start = (
            now.tm_hour + now.tm_min / 60 if opts.day_start_hour is None else opts.day_start_hour
        )
        day = Day(minutes=opts.day_minutes, start_hour=start % 24.0)
        pattern = (
            f"a day in {opts.day_minutes:g} min from {_clock(day.start_hour)} UTC, each region "
            f"peaking at {opts.rps:g} req/s at {PEAK_LOCAL_HOUR:g}:00 local"
        )
    print(
        f"traffic: {pattern} from {', '.join(sorted(endpoints['tenants']))}"
        f", a summary every {opts.summary_every} answers",
        flush=True,
    )
    try:
        asyncio.run(
            run(
                endpoints,
                rps=opts.rps,
                summary_every=opts.summary_every,
                seed=opts.seed,
                day=day,
            )
        )
    except KeyboardInterrupt:
        sys.exit(0)


if __name__ == "__main__":
    main()
