"""A cold model through a real edge process (file mode, a schema-5 table with ``cold_models``):
listed, held rather than refused, charged to the tenant's rate while held, released in arrival
order to the instance the next table lists — and a client that gave up is not sent on."""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from regions.supervisor import wait_http, wait_until
from tests.integration.test_edge_support import (
    EdgeProc,
    Engine,
    instance,
    spawn_engine,
    start_edge,
    table_doc,
)


def h(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


TENANTS = [
    {"tenant": "slow", "key_hashes": [h("fi_slow")], "allowed_regions": ["r1"],
     "requests_per_s": 0.5},
    {"tenant": "any", "key_hashes": [h("fi_any")], "allowed_regions": ["r1"]},
]  # fmt: skip


@pytest.fixture
def cold_edge(tmp_path: Any) -> Iterator[tuple[EdgeProc, Engine, Engine]]:
    llama = spawn_engine(tmp_path, "i-1")
    qwen = spawn_engine(tmp_path, "q-1", "--model", "qwen", "--adapters", "")
    proc: EdgeProc | None = None
    try:
        for e in (llama, qwen):
            wait_http(e.url + "/health", watch=e.proc)
        doc = table_doc("r1", 1, [instance(llama)])
        doc.update(
            schema_version=5,
            tenants=TENANTS,
            cold_models=[{"model": "qwen", "cold_start_s": 60}],
        )
        proc = start_edge(tmp_path, doc, "--rate-burst", "2", "--cold-hold-max", "30")
        yield proc, llama, qwen
    finally:
        if proc is not None:
            proc.proc.stop()
        llama.proc.stop()
        qwen.proc.stop()


class Held:
    """A chat completion for the cold model on a thread (``timeout``: the client gives up)."""

    def __init__(self, edge: EdgeProc, key: str, text: str, timeout: float = 30) -> None:
        self.status = 0
        self.error = ""
        body = {"model": "qwen", "messages": [{"role": "user", "content": text}]}

        def run() -> None:
            try:
                r = httpx.post(
                    edge.url + "/v1/chat/completions",
                    json=body,
                    headers={"Authorization": f"Bearer {key}"},
                    timeout=timeout,
                )
                self.status = r.status_code
            except httpx.HTTPError as exc:
                self.error = exc.__class__.__name__

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def result(self) -> Held:
        self.thread.join(40)
        return self


def chat(edge: EdgeProc, key: str, model: str) -> httpx.Response:
    return httpx.post(
        edge.url + "/v1/chat/completions",
        json={"model": model, "messages": [{"role": "user", "content": "hi"}]},
        headers={"Authorization": f"Bearer {key}"},
        timeout=10,
    )


def cold_counts(edge: EdgeProc) -> dict[str, float]:
    text = httpx.get(edge.ops + "/metrics", timeout=5).text
    out = {}
    for line in text.splitlines():
        if line.startswith("fedinfer_edge_cold_requests_total{"):
            labels, value = line.rsplit(" ", 1)
            out[labels.split('outcome="')[1].split('"')[0]] = float(value)
    return out


def test_held_in_order_charged_and_released_to_the_next_tables_instance(
    cold_edge: tuple[EdgeProc, Engine, Engine],
) -> None:
    edge, llama, qwen = cold_edge
    models = httpx.get(edge.url + "/v1/models", headers={"Authorization": "Bearer fi_any"})
    assert [m["id"] for m in models.json()["data"]] == ["llama", "qwen"]

    first = Held(edge, "fi_slow", "order-1")
    time.sleep(0.3)
    # The held request spent the slow tenant's bucket (burst: 2 s x 0.5/s = one request).
    r = chat(edge, "fi_slow", "llama")
    assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limit_exceeded"
    gone = Held(edge, "fi_any", "gave-up", timeout=0.5)
    gone.result()
    assert gone.error == "ReadTimeout"
    second = Held(edge, "fi_any", "order-2")
    time.sleep(0.2)
    third = Held(edge, "fi_any", "order-3")
    time.sleep(0.3)
    assert qwen.stats()["requests"] == 0 and first.status == 0
    health = httpx.get(edge.ops + "/healthz", timeout=5).json()
    assert health["cold_models"] == {"qwen": 3}  # held now, by served name

    doc = table_doc("r1", 2, [instance(llama), instance(qwen, model="qwen", adapters=[])])
    doc["tenants"] = TENANTS
    tmp = edge.table.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc))
    tmp.rename(edge.table)
    for held in (first, second, third):
        assert held.result().status == 200, held.__dict__
    prompts = [p for p in qwen.stats()["prompts"] if "order-" in p or "gave-up" in p]
    assert [p.split("order-")[1][0] for p in prompts] == ["1", "2", "3"], prompts
    assert cold_counts(edge) == {"released": 3.0, "left": 1.0}  # the one that gave up left


def test_a_model_that_leaves_the_table_while_held_is_a_404(
    cold_edge: tuple[EdgeProc, Engine, Engine],
) -> None:
    edge, llama, _ = cold_edge
    held = Held(edge, "fi_any", "x")
    time.sleep(0.3)
    doc = table_doc("r1", 2, [instance(llama)])
    doc["tenants"] = TENANTS
    tmp = edge.table.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc))
    tmp.rename(edge.table)
    assert held.result().status == 404
    assert chat(edge, "fi_any", "qwen").status_code == 404


def held_now(edge: EdgeProc) -> int:
    health = httpx.get(edge.ops + "/healthz", timeout=5).json()
    return int(health["cold_models"].get("qwen", 0))


def test_one_tenant_flooding_the_hold_line_never_refuses_another(tmp_path: Any) -> None:
    """A line of 4: tenant ``flood`` fills it, and its fifth request is refused; ``calm``'s
    request is held all the same (the flood's newest gives way with 503 ``model_cold``) and
    served with the flood's others once the model is."""
    llama = spawn_engine(tmp_path, "i-1")
    qwen = spawn_engine(tmp_path, "q-1", "--model", "qwen", "--adapters", "")
    tenants = [
        {"tenant": "flood", "key_hashes": [h("fi_flood")], "allowed_regions": ["r1"]},
        {"tenant": "calm", "key_hashes": [h("fi_calm")], "allowed_regions": ["r1"]},
    ]
    edge: EdgeProc | None = None
    try:
        for e in (llama, qwen):
            wait_http(e.url + "/health", watch=e.proc)
        doc = table_doc("r1", 1, [instance(llama)])
        doc.update(schema_version=5, tenants=tenants)
        doc["cold_models"] = [{"model": "qwen", "cold_start_s": 60}]
        edge = start_edge(tmp_path, doc, "--cold-hold-requests", "4", "--cold-hold-max", "30")
        flood = [Held(edge, "fi_flood", f"flood-{n}") for n in range(4)]
        wait_until(lambda: held_now(edge) == 4, what="the flood holding the whole line")
        refused = chat(edge, "fi_flood", "qwen")
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "model_cold"
        calm = Held(edge, "fi_calm", "calm")
        wait_until(
            lambda: sum(1 for f in flood if f.status == 503) == 1,
            what="one of the flood giving way",
            timeout=10,
        )
        assert calm.status == 0 and held_now(edge) == 4  # calm is held, not refused

        warm = table_doc("r1", 2, [instance(llama), instance(qwen, model="qwen", adapters=[])])
        warm["tenants"] = tenants
        tmp = edge.table.with_suffix(".tmp")
        tmp.write_text(json.dumps(warm))
        tmp.rename(edge.table)
        assert calm.result().status == 200
        assert sorted(f.result().status for f in flood) == [200, 200, 200, 503]
    finally:
        if edge is not None:
            edge.proc.stop()
        llama.proc.stop()
        qwen.proc.stop()
