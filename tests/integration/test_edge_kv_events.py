"""The edge consuming vLLM KV-cache events from ``fedinfer engine-sim`` on loopback.

Two simulated engines with a small KV cache (96 blocks of 16 tokens) publish their events; one
edge subscribes to engine 0's, a second edge routes to engine 1 without events (the control).
Distinct long prompts force evictions; afterwards the first prompt is sent again: the engine
no longer holds it, the edge without events still predicts a hit, the edge with events
predicts what the engine reports.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from regions.edge.view.kv_events import CHECK_INTERVAL_S, SETTLE_S
from tests.integration.test_edge_support import (
    EdgeProc,
    engine_sims,
    route_of,
    start_edge,
    table_doc,
)

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
#: Bound on loopback only, in the form vLLM binds (its rule: "*" or "::" in the endpoint).
#: Bound on loopback only, in the form vLLM binds (its rule: "*" or "::" in the endpoint).
EVENTS = (
    '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://[::ffff:127.0.0.1]:0"}'
)


@dataclass
class Pair:
    with_events: EdgeProc
    without_events: EdgeProc


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[Pair]:
    args = ("--num-gpu-blocks", "96", "--max-model-len", "1024", "--seed", "3")
    with engine_sims(tmp_path, 2, MODEL, *args, "--kv-events-config", EVENTS) as engines:
        edges: list[EdgeProc] = []
        try:
            for e in engines:
                inst: dict[str, Any] = {"id": f"sim-{e['index']}", "url": e["url"], "model": MODEL}
                if e["index"] == 0:
                    inst["kv_events_endpoint"] = e["kv_events_endpoint"]
                sub = tmp_path / f"edge-{e['index']}"
                sub.mkdir()
                edges.append(start_edge(sub, table_doc("kv", 1, [inst])))
            time.sleep(1.0)  # the edge's SUB socket joins before the first event (seq 0)
            yield Pair(*edges)
        finally:
            for edge in edges:
                edge.proc.stop()


def prompt(i: int) -> str:
    """~1 900 bytes: ~760 simulator tokens, 464 at the edge's 4 bytes per token (whole blocks)."""
    return f"Document {i}: " + " ".join(f"w{i}x{k} lorem" for k in range(150))


def ask(edge: EdgeProc, i: int) -> tuple[int, int]:
    """(cached tokens the edge predicted, cached tokens the engine reported)."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": prompt(i)}], "max_tokens": 1}
    r = httpx.post(edge.url + "/v1/chat/completions", json=body, timeout=20)
    r.raise_for_status()
    score = route_of(r.headers)["score"]
    predicted = int(dict(t.split(":") for t in score.split(","))["cached"])
    return predicted, r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def metric(edge: EdgeProc, name: str) -> float:
    text = httpx.get(edge.ops + "/metrics", timeout=5).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


def test_kv_events_stop_the_edge_predicting_hits_on_evicted_prefixes(pair: Pair) -> None:
    n = 8  # 8 x ~760 tokens through a 1 536-token cache
    for edge in (pair.with_events, pair.without_events):
        for i in range(n):
            assert ask(edge, i) == (0, 0)  # all distinct: nothing cached anywhere yet
    time.sleep(SETTLE_S + 3 * CHECK_INTERVAL_S)  # the last entries settle, the check runs

    # The latest prompt is still held: both edges predict it, the engines confirm.
    for edge in (pair.with_events, pair.without_events):
        predicted, actual = ask(edge, n - 1)
        assert predicted > 300 and actual > 300

    # The first prompt was evicted long ago on both engines.
    predicted, actual = ask(pair.without_events, 0)
    assert actual == 0 and predicted > 300  # the over-prediction events correct
    predicted, actual = ask(pair.with_events, 0)
    assert (predicted, actual) == (0, 0)

    assert metric(pair.with_events, "fedinfer_edge_kv_event_evicted_blocks_total") > 0
    assert metric(pair.with_events, "fedinfer_edge_kv_event_gaps_total") == 0
    held = metric(pair.with_events, "fedinfer_edge_kv_engine_cached_tokens")
    assert 0 < held <= 96 * 16
    assert metric(pair.without_events, "fedinfer_edge_kv_event_batches_total") == 0
