"""A remote region with two edges (schema 4, three real edges on loopback): requests spread
over both, a session keeps meeting the same one, and when one dies spill-over moves to the
other before the first byte, with no failed request."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from regions.supervisor import wait_http
from tests.integration.test_edge_support import (
    EdgeProc,
    instance,
    route_of,
    spawn_engine,
    start_edge,
    table_doc,
)


@dataclass
class Fed:
    entry: EdgeProc
    remote: dict[str, EdgeProc]


@pytest.fixture
def fed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fed]:
    tmp = tmp_path_factory.mktemp("edges")
    procs = []
    try:
        # r2 serves qwen through two edges, each in front of its own engine (so the route's
        # instance says which edge took the request); r1 does not serve qwen at all.
        engines = {name: spawn_engine(tmp, name, "--model", "qwen") for name in ("qa", "qb")}
        local = spawn_engine(tmp, "l1")
        procs += [e.proc for e in (*engines.values(), local)]
        for e in (*engines.values(), local):
            wait_http(e.url + "/health", watch=e.proc)
        remote = {}
        for name, engine in engines.items():
            (tmp / name).mkdir()
            remote[name] = start_edge(
                tmp / name, table_doc("r2", 1, [instance(engine, model="qwen")])
            )
            procs.append(remote[name].proc)
        (tmp / "r1").mkdir()
        doc = table_doc("r1", 1, [instance(local)])
        doc["schema_version"] = 4
        doc["remote_regions"] = [
            {
                "code": "r2",
                "edge_url": remote["qa"].url,
                "edges": [remote["qb"].url],
                "rtt_ms": 5,
                "models": ["qwen"],
                "headroom": 0.5,
            }
        ]
        entry = start_edge(tmp / "r1", doc)
        procs.append(entry.proc)
        yield Fed(entry, remote)
    finally:
        for p in reversed(procs):
            p.stop()


def ask(fed: Fed, **headers: str) -> str:
    """The instance (so the remote edge) that served one qwen request through r1."""
    r = httpx.post(
        fed.entry.url + "/v1/chat/completions",
        json={"model": "qwen", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        headers=headers,
        timeout=15,
    )
    assert r.status_code == 200, r.text
    route = route_of(r.headers)
    assert (route["region"], route["spill"]) == ("r2", "not_local")
    return route["instance"]


def test_requests_spread_over_a_regions_edges_and_a_session_keeps_its_edge(fed: Fed) -> None:
    assert {ask(fed) for _ in range(6)} == {"qa", "qb"}
    for session in ("s-1", "s-2", "s-3", "s-4"):
        first = ask(fed, **{"x-session-id": session})
        assert all(ask(fed, **{"x-session-id": session}) == first for _ in range(4))


def test_a_dead_remote_edge_is_passed_over_with_no_failed_request(fed: Fed) -> None:
    fed.remote["qa"].proc.send_signal(signal.SIGKILL)
    fed.remote["qa"].proc.wait(10)
    served = [ask(fed) for _ in range(10)] + [
        ask(fed, **{"x-session-id": f"s-{i}"}) for i in range(10)
    ]
    assert set(served) == {"qb"}
