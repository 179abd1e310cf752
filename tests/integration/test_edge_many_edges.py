"""Several edges of one region, one view: a session meets the same instance at every edge, and
a tenant's rate limit holds across the edges (real edge processes, file mode)."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from regions.supervisor import wait_http
from tests.integration.test_edge_support import (
    EdgeProc,
    Engine,
    instance,
    route_of,
    spawn_engine,
    start_edge,
    table_doc,
    wait_admitted,
)

EDGES = 3
LIMIT_RPS = 4.0
BURST_S = 2.0


def h(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


@pytest.fixture(scope="module")
def region(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[EdgeProc]]:
    """Four engines behind three edges sharing one table (``local_edges`` 3)."""
    tmp = tmp_path_factory.mktemp("many-edges")
    engines: list[Engine] = []
    edges: list[EdgeProc] = []
    try:
        engines = [spawn_engine(tmp, f"i-{k}") for k in range(1, 5)]
        for e in engines:
            wait_http(e.url + "/health", watch=e.proc)
        doc: dict[str, Any] = table_doc("r1", 1, [instance(e) for e in engines])
        doc["schema_version"] = 5
        doc["local_edges"] = EDGES
        doc["tenants"] = [
            {"tenant": "free", "key_hashes": [h("fi_free")], "allowed_regions": ["r1"]},
            {"tenant": "capped", "key_hashes": [h("fi_capped")], "allowed_regions": ["r1"],
             "requests_per_s": LIMIT_RPS},
        ]  # fmt: skip
        for k in range(EDGES):
            own = tmp / f"edge-{k}"
            own.mkdir()
            edges.append(start_edge(own, doc, "--rate-burst", str(BURST_S)))
        wait_admitted(*edges)
        yield edges
    finally:
        for edge in edges:
            edge.proc.stop()
        for e in engines:
            e.proc.stop()


def chat(url: str, key: str, session: str | None = None, text: str = "hi") -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"}
    if session is not None:
        headers["x-session-id"] = session
    return httpx.post(
        url + "/v1/chat/completions",
        json={"model": "llama", "messages": [{"role": "user", "content": text}], "max_tokens": 4},
        headers=headers,
        timeout=10,
    )


def test_a_session_meets_the_same_instance_at_every_edge(region: list[EdgeProc]) -> None:
    sessions = [f"chat-{n}" for n in range(24)]
    placed: dict[str, set[str]] = {}
    for k, edge in enumerate(region):
        # Each edge sees the sessions in another order (as behind a balancer), so nothing but
        # the session itself can make the edges agree; none has seen the session before.
        for session in sessions[7 * k :] + sessions[: 7 * k]:
            r = chat(edge.url, "fi_free", session, text=f"turn of {session}")
            assert r.status_code == 200, r.text
            placed.setdefault(session, set()).add(route_of(r.headers)["instance"])
    assert all(len(where) == 1 for where in placed.values()), placed
    # ... and the sessions are spread over the instances, not all on one.
    assert len({next(iter(where)) for where in placed.values()}) >= 3


def test_a_rate_limit_holds_across_the_edges(region: list[EdgeProc]) -> None:
    """One tenant at 4x its limit, each request to the next edge: the region admits its limit
    over the span plus one burst (each edge enforces a third), not three times that."""
    statuses: list[int] = []
    period = 1.0 / (4 * LIMIT_RPS)
    start = time.monotonic()
    k = 0
    while (due := start + k * period) < start + 3.0:
        time.sleep(max(0.0, due - time.monotonic()))
        statuses.append(chat(region[k % EDGES].url, "fi_capped").status_code)
        k += 1
    span = time.monotonic() - start
    admitted = statuses.count(200)
    assert set(statuses) <= {200, 429}
    bound = LIMIT_RPS * span + LIMIT_RPS * BURST_S  # 1/3 of the rate and burst at each edge
    assert admitted <= bound + 1, (admitted, bound)
    assert admitted >= LIMIT_RPS * 3.0, (admitted, bound)  # and the tenant gets its rate
