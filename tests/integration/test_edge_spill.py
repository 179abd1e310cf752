"""Spill-over between two real edges on loopback (file mode, tables with tenants).

Region ``r1`` has one slow ``llama`` engine (cap 1, no gateway queue); region ``r2`` has a
``llama`` and a ``qwen`` engine. ``r1``'s table lists ``r2`` as a remote region.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import orjson
import pytest

from regions.edge.policy.hop import hop_keys, sign_hop
from regions.supervisor import wait_http
from regions.tables.signing import parse_key_ring
from tests.integration.test_edge_support import (
    EdgeProc,
    Engine,
    instance,
    route_of,
    spawn_engine,
    start_edge,
    table_doc,
)


def h(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


TENANTS = [
    {"tenant": "eu", "key_hashes": [h("fi_eu")], "allowed_regions": ["r1"]},
    {"tenant": "any", "key_hashes": [h("fi_any")], "allowed_regions": ["r1", "r2"]},
    {"tenant": "us", "key_hashes": [h("fi_us")], "allowed_regions": ["r2"]},
    # A bucket of one at each edge, refilled once a minute: whatever the machine's load, the
    # bucket a test spent stays spent for the whole test (at 0.5/s a loaded machine refilled it
    # between two requests).
    {
        "tenant": "metered",
        "key_hashes": [h("fi_metered")],
        "allowed_regions": ["r1", "r2"],
        "requests_per_s": 1 / 60,
    },
]
#: Both edges sign and verify forwarded requests with it (``--hop-keys-file``).
HOP_KEYS = "h2=hop-secret-new,h1=hop-secret-old"


@dataclass
class Fed:
    r1: EdgeProc
    r2: EdgeProc
    e1: Engine
    e2: Engine
    q2: Engine
    r1_table: dict[str, Any]


@pytest.fixture(scope="module")
def fed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fed]:
    tmp = tmp_path_factory.mktemp("spill")
    hop_file = tmp / "hop-keys"
    hop_file.write_text(HOP_KEYS)
    procs = []
    try:
        e1 = spawn_engine(tmp, "e1", "--token-delay", "0.3", "--tokens", "4")
        e2 = spawn_engine(tmp, "e2")
        q2 = spawn_engine(tmp, "q2", "--model", "qwen")
        procs += [e1.proc, e2.proc, q2.proc]
        for e in (e1, e2, q2):
            wait_http(e.url + "/health", watch=e.proc)
        (tmp / "r2").mkdir()
        t2 = table_doc("r2", 1, [instance(e2), instance(q2, model="qwen")])
        t2["tenants"] = TENANTS
        r2 = start_edge(tmp / "r2", t2, "--hop-keys-file", str(hop_file))
        procs.append(r2.proc)
        (tmp / "r1").mkdir()
        t1 = table_doc("r1", 1, [instance(e1, max_concurrency=1)])
        t1["tenants"] = TENANTS
        t1["remote_regions"] = [
            {"code": "r2", "edge_url": r2.url, "rtt_ms": 5, "models": ["llama", "qwen"],
             "headroom": 0.5}
        ]  # fmt: skip
        r1 = start_edge(tmp / "r1", t1, "--queue-size", "0", "--hop-keys-file", str(hop_file))
        procs.append(r1.proc)
        yield Fed(r1, r2, e1, e2, q2, t1)
    finally:
        for p in reversed(procs):
            p.stop()


def chat(url: str, key: str, model: str = "llama", **headers: str) -> httpx.Response:
    return httpx.post(
        url + "/v1/chat/completions",
        json={"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        headers={"Authorization": f"Bearer {key}", **headers},
        timeout=15,
    )


def test_model_not_local_spills_to_an_allowed_region(fed: Fed) -> None:
    r = chat(fed.r1.url, "fi_any", "qwen")
    assert r.status_code == 200, r.text
    route = route_of(r.headers)
    assert route["region"] == "r2" and route["remote_from"] == "r1"
    assert route["spill"] == "not_local" and route["instance"] == "q2"
    # Residency is hard: an EU-only tenant is refused, never sent to r2.
    served = fed.q2.stats()["requests"]
    r = chat(fed.r1.url, "fi_eu", "qwen")
    assert r.status_code == 503 and r.json()["error"]["code"] == "no_allowed_region"
    assert fed.q2.stats()["requests"] == served


def test_tenant_not_allowed_here_is_served_in_its_region(fed: Fed) -> None:
    before = fed.e1.stats()["requests"]
    r = chat(fed.r1.url, "fi_us")
    assert r.status_code == 200
    route = route_of(r.headers)
    assert route["region"] == "r2" and route["spill"] == "residency"
    assert fed.e1.stats()["requests"] == before


def test_a_forwarded_request_is_never_forwarded_again(fed: Fed) -> None:
    # r2 lacks nothing here, so ask r1 for qwen as if it came from another edge.
    r = chat(fed.r1.url, "fi_any", "qwen", **{"x-fedinfer-hop": "1"})
    assert r.status_code == 503 and r.json()["error"]["code"] == "no_local_instance"


def test_saturated_region_spills_unrestricted_tenant_but_refuses_eu_only(fed: Fed) -> None:
    hold = threading.Thread(
        target=lambda: httpx.post(
            fed.r1.url + "/v1/chat/completions",
            json={"model": "llama", "messages": [{"role": "user", "content": "hold"}]},
            headers={"Authorization": "Bearer fi_eu"},
            timeout=15,
        )
    )
    hold.start()
    deadline = time.monotonic() + 5
    while fed.e1.stats()["running"] < 1:
        assert time.monotonic() < deadline, "holder never reached the engine"
        time.sleep(0.02)
    e2_before = fed.e2.stats()["requests"]
    eu = chat(fed.r1.url, "fi_eu")
    anyone = chat(fed.r1.url, "fi_any")
    hold.join()
    assert eu.status_code in (429, 503), eu.text
    assert "retry-after" in eu.headers
    assert anyone.status_code == 200
    assert route_of(anyone.headers)["region"] == "r2"
    assert fed.e2.stats()["requests"] == e2_before + 1  # only the unrestricted one


def test_evacuated_region_sends_traffic_to_the_remote(fed: Fed) -> None:
    doc = dict(fed.r1_table, version=2, instances=[])
    tmp = fed.r1.table.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc))
    tmp.replace(fed.r1.table)
    deadline = time.monotonic() + 5
    while httpx.get(fed.r1.ops + "/healthz").json()["table_version"] != 2:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    r = chat(fed.r1.url, "fi_any")
    assert r.status_code == 200 and route_of(r.headers)["region"] == "r2"
    r = chat(fed.r1.url, "fi_eu")
    assert r.status_code == 503 and r.json()["error"]["code"] == "no_allowed_region"
    assert "retry-after" in r.headers


def test_streaming_passes_through_the_remote_edge(fed: Fed) -> None:
    with httpx.stream(
        "POST",
        fed.r1.url + "/v1/chat/completions",
        json={"model": "qwen", "messages": [{"role": "user", "content": "s"}], "stream": True},
        headers={"Authorization": "Bearer fi_any"},
        timeout=15,
    ) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        assert route_of(r.headers)["remote_from"] == "r1"
        body = b"".join(r.iter_bytes())
    assert body.rstrip().endswith(b"data: [DONE]") and b"q2:" in body


def test_a_spilled_request_is_rate_charged_once_where_it_entered(fed: Fed) -> None:
    # r2's bucket of one is spent by a request served there directly...
    assert chat(fed.r2.url, "fi_metered").status_code == 200
    assert chat(fed.r2.url, "fi_metered").status_code == 429
    # ...yet a request entering at r1 (its own bucket full) and forwarded to r2 for qwen is
    # served: r1 charged it, and r2 trusts r1's signed hop instead of charging it again.
    r = chat(fed.r1.url, "fi_metered", "qwen")
    assert r.status_code == 200, r.text
    assert route_of(r.headers)["remote_from"] == "r1"
    # A client cannot claim to be a hop: a forged value is charged as usual.
    forged = f"v2.r1.r2.{'0' * 32}.{int(time.time() * 1000)}.h2.{'0' * 64}"
    r = chat(fed.r2.url, "fi_metered", **{"x-fedinfer-hop": forged})
    assert r.status_code == 429, r.text
    # A genuine value (as r1 signs it) is taken once at r2; captured and sent again, to another
    # region or with another tenant's key, it is charged as usual.
    keys = hop_keys(parse_key_ring(HOP_KEYS))
    body = orjson.dumps({"model": "llama", "messages": [{"role": "user", "content": "hi"}]})
    auth = b"Bearer fi_metered"

    def hop(dest: str, signed_auth: bytes = auth) -> bytes:
        return sign_hop(keys, "r1", dest, signed_auth, body, int(time.time() * 1000))

    def post(value: bytes) -> int:
        headers = {"Authorization": auth.decode(), "x-fedinfer-hop": value.decode()}
        headers["Content-Type"] = "application/json"
        url = fed.r2.url + "/v1/chat/completions"
        return httpx.post(url, content=body, headers=headers, timeout=15).status_code

    captured = hop("r2")
    assert post(captured) == 200
    assert post(captured) == 429
    assert post(hop("r3")) == 429
    assert post(hop("r2", b"Bearer fi_any")) == 429


def test_a_request_whose_engine_just_died_is_served_by_another_region(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """The region's only engine dies between two health probes: the request that finds it
    dead (connection refused, nothing sent) is placed again, and with no local instance left
    it goes to the other region instead of failing (the failover bench's region loss saw one
    such request fail)."""
    tmp = tmp_path_factory.mktemp("dead-engine")
    hop_file = tmp / "hop-keys"
    hop_file.write_text(HOP_KEYS)
    procs = []
    try:
        e1, e2 = spawn_engine(tmp, "e1"), spawn_engine(tmp, "e2")
        procs += [e1.proc, e2.proc]
        for e in (e1, e2):
            wait_http(e.url + "/health", watch=e.proc)
        (tmp / "r2").mkdir()
        t2 = table_doc("r2", 1, [instance(e2)])
        t2["tenants"] = TENANTS
        r2 = start_edge(tmp / "r2", t2, "--hop-keys-file", str(hop_file))
        procs.append(r2.proc)
        (tmp / "r1").mkdir()
        t1 = table_doc("r1", 1, [instance(e1)])
        t1["tenants"] = TENANTS
        t1["remote_regions"] = [
            {"code": "r2", "edge_url": r2.url, "rtt_ms": 5, "models": ["llama"], "headroom": 0.5}
        ]
        r1 = start_edge(tmp / "r1", t1, "--hop-keys-file", str(hop_file), "--probe-interval", "60")
        procs.append(r1.proc)
        first = chat(r1.url, "fi_any")
        assert first.status_code == 200 and route_of(first.headers)["region"] == "r1"
        e1.proc.stop()
        r = chat(r1.url, "fi_any")
        assert r.status_code == 200, r.text
        assert route_of(r.headers)["region"] == "r2"
    finally:
        for p in reversed(procs):
            p.stop()
