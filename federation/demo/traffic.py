"""The demo's traffic generator: a few requests per second from tenants of different
jurisdictions, each to an edge in a region it may use, streaming and not.

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
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
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
        return (
            f"traffic {self.total} req ({self.streamed} streamed) in {elapsed:.1f}s"
            f" | {statuses} | {tenants}"
        )


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

    def __init__(self, summary_every: int) -> None:
        self.summary_every = summary_every
        self.window = Window()

    def record(self, tenant: str, stream: bool, status: str, path: str) -> None:
        self.window.add(tenant, stream, status, path)
        if self.window.total >= self.summary_every:
            print(self.window.line(), flush=True)
            self.window = Window()


async def one_request(
    http: httpx.AsyncClient, client: Client, rng: random.Random, tally: Tally
) -> None:
    """Send one chat completion and record how it was answered and where."""
    region, url = rng.choice(client.edges)
    stream = rng.random() < 0.5
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": rng.choice(PROMPTS)}],
        "max_tokens": rng.randint(8, 32),
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


async def run(endpoints: dict[str, Any], *, rps: float, summary_every: int, seed: int) -> None:
    """Send ``rps`` requests per second, tenants in turn (each stays under its rate limit),
    until cancelled."""
    clients = clients_from(endpoints)
    rng = random.Random(seed)
    tally = Tally(summary_every)
    pending: set[asyncio.Task[None]] = set()
    loop = asyncio.get_running_loop()
    async with httpx.AsyncClient(timeout=httpx.Timeout(30.0, connect=2.0)) as http:
        started = loop.time()
        for n, client in enumerate(itertools.cycle(clients)):
            # Paced from the start: a slow answer does not lower the rate.
            await asyncio.sleep(max(0.0, started + n / rps - loop.time()))
            task = asyncio.create_task(one_request(http, client, rng, tally))
            pending.add(task)  # the loop holds only weak references to tasks
            task.add_done_callback(pending.discard)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="demo_traffic", description=__doc__.split("\n\n")[0])
    parser.add_argument("--endpoints", type=Path, required=True, help="the demo's endpoints.json")
    parser.add_argument("--rps", type=float, default=4.0, help="requests per second")
    parser.add_argument("--summary-every", type=int, default=20, help="answers per summary line")
    parser.add_argument("--seed", type=int, default=1)
    opts = parser.parse_args(argv)
    if opts.rps <= 0 or opts.summary_every < 1:
        parser.error("--rps must be > 0 and --summary-every >= 1")
    endpoints = json.loads(opts.endpoints.read_text())
    print(
        f"traffic: {opts.rps:g} req/s from {', '.join(sorted(endpoints['tenants']))}"
        f", a summary every {opts.summary_every} answers",
        flush=True,
    )
    try:
        asyncio.run(run(endpoints, rps=opts.rps, summary_every=opts.summary_every, seed=opts.seed))
    except KeyboardInterrupt:
        sys.exit(0)


if __name__ == "__main__":
    main()
