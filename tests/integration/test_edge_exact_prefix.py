"""Two edges, one view: exact prefix knowledge from tokens and KV events, on loopback.

Two simulated engines tokenize with the bench model's tokenizer.json and hash blocks as vLLM's
``sha256_cbor`` (``--tokenizer``, ``--prefix-caching-hash-algo``), publishing KV events; two
edges, each with the same tokenizer, subscribe to both engines. Only edge A routes the warm-up
traffic, so edge B's own (byte) index knows nothing of it; yet for a new request sharing a
warm prefix both edges predict the same cached tokens — what the engine then reports — and
pick the same instance: what they know comes from the engines, not from their own traffic.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from bench.harness.tokenizer import build
from regions.edge.view.token_prefix import CHARS_PER_ID, RECENT_S
from regions.supervisor import wait_until
from tests.integration.test_edge_support import (
    EdgeProc,
    engine_sims,
    route_of,
    start_edge,
    table_doc,
)

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
#: Bound on loopback only, in the form vLLM binds (its rule: "*" or "::" in the endpoint).
EVENTS = (
    '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://[::ffff:127.0.0.1]:0"}'
)


@dataclass
class Region:
    a: EdgeProc
    b: EdgeProc


@pytest.fixture
def region(tmp_path: Path) -> Iterator[Region]:
    tokenizer = build(tmp_path / "tokenizer")
    args = ("--max-model-len", "4096", "--seed", "5", "--tokenizer", str(tokenizer))
    args += ("--prefix-caching-hash-algo", "sha256_cbor", "--kv-events-config", EVENTS)
    with engine_sims(tmp_path, 2, MODEL, *args) as engines:
        instances: list[dict[str, Any]] = [
            {
                "id": f"sim-{e['index']}",
                "url": e["url"],
                "model": MODEL,
                "kv_events_endpoint": e["kv_events_endpoint"],
            }
            for e in engines
        ]
        edges: list[EdgeProc] = []
        try:
            for name in ("a", "b"):
                sub = tmp_path / f"edge-{name}"
                sub.mkdir()
                table = table_doc("exact", 1, instances)
                edges.append(start_edge(sub, table, "--tokenizer", f"{MODEL}={tokenizer}"))
            time.sleep(1.0)  # the SUB sockets join before the first event (seq 0)
            yield Region(*edges)
        finally:
            for edge in edges:
                edge.proc.stop()


SYSTEMS = [
    f"You are assistant {k}. "
    + " ".join(f"rule {k}.{i}: route the request well." for i in range(40))
    for k in range(3)
]


def ask(edge: EdgeProc, system: str, user: str) -> tuple[int, int, str]:
    """(cached tokens the edge predicted, cached tokens the engine reported, instance)."""
    messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
    body = {"model": MODEL, "messages": messages, "max_tokens": 1}
    r = httpx.post(edge.url + "/v1/chat/completions", json=body, timeout=20)
    r.raise_for_status()
    route = route_of(r.headers)
    predicted = int(dict(t.split(":") for t in route["score"].split(","))["cached"])
    cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    return predicted, cached, route["instance"]


def exact_equal(edge: EdgeProc) -> float:
    text = httpx.get(edge.ops + "/metrics", timeout=5).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("fedinfer_edge_cached_predictions_total")
        and 'path="exact"' in line
        and 'outcome="equal"' in line
    )


def test_two_edges_predict_the_same_cached_tokens_from_the_engines_events(region: Region) -> None:
    # Warm-up through edge A only: each system prompt lands on some engine.
    for k, system in enumerate(SYSTEMS):
        ask(region.a, system, f"warm-up question {k}")
        time.sleep(0.3)  # its blocks are reported before the next one is placed
    time.sleep(RECENT_S + 0.5)  # A's own recent routing no longer counts: only the events

    for k, system in enumerate(SYSTEMS):
        # Users' texts differ from their first word: both share exactly the warm-up's prefix.
        on_b = ask(region.b, system, f"Bravo, a new question {k}")
        time.sleep(RECENT_S + 0.5)
        on_a = ask(region.a, system, f"Alpha, a new question {k}")
        time.sleep(RECENT_S + 0.5)
        # Both edges see the system prompt's blocks on the same engine, and say so exactly.
        assert on_b[0] == on_b[1] > 100, on_b
        assert on_a[0] == on_a[1] == on_b[0], (on_a, on_b)
        assert on_a[2] == on_b[2]
    assert exact_equal(region.b) >= len(SYSTEMS)
    assert exact_equal(region.a) >= len(SYSTEMS)


def following_events(edge: EdgeProc, engine_url: str) -> bool:
    """Ask the engine to clear its prefix cache (an ``AllBlocksCleared`` event: a known state,
    however late the edge joined); whether the edge now follows the engine's cache."""
    httpx.post(engine_url + "/reset_prefix_cache", timeout=5).raise_for_status()
    text = httpx.get(edge.ops + "/metrics", timeout=5).text
    return any(
        line.startswith("fedinfer_edge_kv_engine_cached_tokens{") and float(line.split()[-1]) >= 0
        for line in text.splitlines()
    )


def complete_ids(edge: EdgeProc, ids: list[int]) -> tuple[int, int, int]:
    """(cached tokens the edge predicted, prompt and cached tokens the engine reported)."""
    body = {"model": MODEL, "prompt": ids, "max_tokens": 1}
    r = httpx.post(edge.url + "/v1/completions", json=body, timeout=20)
    r.raise_for_status()
    predicted = int(dict(t.split(":") for t in route_of(r.headers)["score"].split(","))["cached"])
    usage = r.json()["usage"]
    return predicted, usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]


def test_a_token_id_prompt_is_hashed_only_as_far_as_the_text_cut(tmp_path: Path) -> None:
    """``--tokenize-max-chars 1024``: a text prompt's blocks are hashed up to ~1024 characters,
    a token-id prompt's up to 1024 // CHARS_PER_ID ids; the engine still gets all of it."""
    tokenizer = build(tmp_path / "tokenizer")
    args = ("--max-model-len", "4096", "--seed", "5", "--tokenizer", str(tokenizer))
    args += ("--prefix-caching-hash-algo", "sha256_cbor", "--kv-events-config", EVENTS)
    cap = 1024 // CHARS_PER_ID
    with engine_sims(tmp_path, 1, MODEL, *args) as engines:
        instances = [
            {"id": "sim-0", "url": engines[0]["url"], "model": MODEL,
             "kv_events_endpoint": engines[0]["kv_events_endpoint"]},
        ]  # fmt: skip
        edge = start_edge(
            tmp_path, table_doc("exact", 1, instances),
            "--tokenizer", f"{MODEL}={tokenizer}", "--tokenize-max-chars", "1024",
        )  # fmt: skip
        try:
            wait_until(
                lambda: following_events(edge, engines[0]["url"]),
                what="the edge following the engine's KV events",
            )
            ids = [(7 * i) % 1000 + 10 for i in range(3000)]
            assert complete_ids(edge, ids)[1] == 3000
            # At once: this edge's own routing of the prompt counts as the engine holding it.
            predicted, prompt, cached = complete_ids(edge, [*ids[:2999], 5])
            assert prompt == 3000 and cached >= 2900  # the engine got and cached all of it
            assert 0 < predicted <= cap, predicted  # the edge hashed the head alone
        finally:
            edge.proc.stop()
