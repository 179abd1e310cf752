"""The routes beyond chat and completions (``/v1/responses``, ``/v1/embeddings``, the pooling
routes, ``/tokenize``, ``/detokenize``) through real edges in front of the engine simulator:
the same admission, residency, scheduling, route header and usage records as completions."""

from __future__ import annotations

import hashlib
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import redis

from regions.supervisor import wait_until
from regions.tables.usage import USAGE_FIELD, USAGE_STREAM, decode_record
from tests.integration.test_edge_support import (
    EdgeProc,
    engine_sims,
    route_of,
    start_edge,
    table_doc,
)
from tests.integration.usage_stream_support import stream_args

REDIS_URL = os.environ["REDIS_URL"]  # this test worker's own (tests/isolation.py)
MODEL = "meta-llama/Llama-3.1-8B-Instruct"
HOP_KEYS = "h1=hop-secret"
MAX_BODY = 65536


def h(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


TENANTS = [
    {"tenant": "eu", "key_hashes": [h("fi_eu")], "allowed_regions": ["r1"]},
    {"tenant": "us", "key_hashes": [h("fi_us")], "allowed_regions": ["r2"]},
    {"tenant": "slow", "key_hashes": [h("fi_slow")], "allowed_regions": ["r1"],
     "requests_per_s": 0.5},
]  # fmt: skip


@dataclass
class Fed:
    r1: EdgeProc
    r2: EdgeProc
    r1_engines: dict[str, str]
    r2_engines: dict[str, str]
    stream: redis.Redis


@pytest.fixture(scope="module")
def fed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fed]:
    tmp = tmp_path_factory.mktemp("routes")
    client = redis.Redis.from_url(REDIS_URL)
    client.delete(USAGE_STREAM)
    hop_file = tmp / "hop-keys"
    hop_file.write_text(HOP_KEYS)
    (tmp / "s1").mkdir()
    (tmp / "s2").mkdir()
    with (
        engine_sims(tmp / "s1", 2, MODEL) as sims1,
        engine_sims(tmp / "s2", 1, MODEL) as sims2,
    ):
        r1_engines = {f"a-{e['index']}": e["url"] for e in sims1}
        r2_engines = {f"b-{e['index']}": e["url"] for e in sims2}
        edges: list[EdgeProc] = []
        try:
            edges.append(_edge(tmp, "r2", r2_engines, hop_file, remote=None))
            edges.append(_edge(tmp, "r1", r1_engines, hop_file, remote=edges[0].url))
            yield Fed(edges[1], edges[0], r1_engines, r2_engines, client)
        finally:
            for edge in edges:
                edge.proc.stop()
            client.delete(USAGE_STREAM)


def _edge(
    tmp: Path, region: str, engines: dict[str, str], hop_file: Path, remote: str | None
) -> EdgeProc:
    insts = [
        {"id": name, "url": url, "model": MODEL, "max_concurrency": 1, "prefill_tokens_per_s": 8000}
        for name, url in engines.items()
    ]
    doc = table_doc(region, 1, insts)
    doc["tenants"] = TENANTS
    if remote is not None:
        doc["remote_regions"] = [
            {"code": "r2", "edge_url": remote, "rtt_ms": 5, "models": [MODEL], "headroom": 0.5}
        ]
    (tmp / region).mkdir()
    return start_edge(
        tmp / region,
        doc,
        "--hop-keys-file",
        str(hop_file),
        "--max-body-bytes",
        str(MAX_BODY),
        "--queue-size",
        "0",
        *stream_args(tmp / region, f"edge-{region}"),
        "--usage-spool-dir",
        str(tmp / region / "spool"),
        "--usage-redis-url",
        REDIS_URL,
    )


def post(url: str, path: str, body: Any, key: str | None = "fi_eu") -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(url + path, json=body, headers=headers, timeout=30)


def records(client: redis.Redis, since: float) -> list[Any]:
    """Usage records of requests that started after ``since`` (epoch seconds)."""
    entries = client.xrange(USAGE_STREAM)
    found = [decode_record(r) for _, f in entries for r in f[USAGE_FIELD].splitlines()]
    return [r for r in found if r.started_at >= since]


def wait_records(client: redis.Redis, n: int, since: float) -> list[Any]:
    wait_until(lambda: len(records(client, since)) >= n, what=f"{n} usage records", timeout=20)
    time.sleep(1.0)  # nothing more may come
    found = records(client, since)
    assert len(found) == n, found
    return found


def sse_events(body: bytes) -> list[dict[str, Any]]:
    out = []
    for block in body.decode().split("\n\n"):
        if block:
            head, data = block.split("\n", 1)
            doc = orjson.loads(data[len("data: ") :])
            assert head == f"event: {doc['type']}"
            out.append(doc)
    return out


def _comparable(doc: Any) -> Any:
    """An answer without what differs between two calls (ids, timestamps)."""
    if isinstance(doc, dict):
        return {
            k: _comparable(v)
            for k, v in doc.items()
            if k not in ("id", "created", "created_at", "item_id", "cached_tokens")
        }
    if isinstance(doc, list):
        return [_comparable(v) for v in doc]
    return doc


ROUTES: list[tuple[str, dict[str, Any]]] = [
    ("/tokenize", {"prompt": "Route the request to the engine that holds the prefix."}),
    ("/tokenize", {"messages": [{"role": "user", "content": "hello there"}]}),
    ("/detokenize", {"tokens": []}),  # filled in from /tokenize's answer
    ("/v1/embeddings", {"input": ["first text", "the second text, longer"]}),
    ("/v2/embed", {"texts": ["cohere style"], "input_type": "search_document"}),
    ("/pooling", {"input": "pool this"}),
    ("/classify", {"input": ["one", "two"]}),
    ("/score", {"text_1": "query", "text_2": ["doc a", "doc b"]}),
    ("/v1/score", {"queries": "query", "documents": ["doc a"]}),
    ("/rerank", {"query": "query", "documents": ["doc a", "doc b", "doc c"], "top_n": 2}),
    ("/v1/rerank", {"query": "query", "documents": ["doc a"]}),
    ("/v2/rerank", {"query": "query", "documents": ["doc a", "doc b"]}),
    ("/v1/responses", {"input": "Which engine holds it?", "max_output_tokens": 8}),
]


def test_every_route_answers_as_the_engine_does_with_its_route_explained(fed: Fed) -> None:
    tokens: list[int] = []
    for path, extra in ROUTES:
        body = {"model": MODEL, **extra}
        if path == "/detokenize":
            body["tokens"] = tokens
        resp = post(fed.r1.url, path, body)
        assert resp.status_code == 200, (path, resp.text)
        route = route_of(resp.headers)
        assert route["region"] == "r1" and route["instance"] in fed.r1_engines, (path, route)
        assert route["policy_reason"] == ("unqueued" if "tokenize" in path else "best_ttft")
        assert "server-timing" in resp.headers
        direct = httpx.post(fed.r1_engines[route["instance"]] + path, json=body, timeout=30)
        assert _comparable(resp.json()) == _comparable(direct.json()), path
        if path == "/tokenize" and "prompt" in extra:
            tokens = resp.json()["tokens"]
            assert resp.json()["count"] > 5
    assert post(fed.r1.url, "/detokenize", {"model": MODEL, "tokens": tokens}).json() == {
        "prompt": ROUTES[0][1]["prompt"]
    }


def test_admission_refuses_on_every_route(fed: Fed) -> None:
    url = fed.r1.url
    for path in ("/v1/responses", "/v1/embeddings", "/rerank", "/tokenize", "/detokenize"):
        body = {"model": MODEL, "input": "x", "prompt": "x", "tokens": [1], "documents": ["d"]}
        assert post(url, path, body, key=None).status_code == 401, path
        assert post(url, path, body, key="fi_wrong").status_code == 401, path
        assert httpx.get(url + path, timeout=5).status_code == 405, path
        unknown = post(url, path, {**body, "model": "nope"})
        assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
        edge_only = post(url, path, {**body, "priority": -10})
        assert edge_only.json()["error"]["code"] == "edge_only_field", path
        big = post(url, path, {**body, "input": "x" * MAX_BODY})
        assert big.status_code == 413, path
    too_many = post(url, "/v1/embeddings", {"model": MODEL, "input": ["a"] * 2049})
    assert too_many.status_code == 400 and too_many.json()["error"]["code"] == "too_many_inputs"
    docs = post(url, "/v1/rerank", {"model": MODEL, "query": "q", "documents": ["d"] * 2049})
    assert docs.status_code == 400 and docs.json()["error"]["param"] == "documents"
    stored = post(
        url, "/v1/responses", {"model": MODEL, "input": "hi", "previous_response_id": "resp_1"}
    )
    assert stored.status_code == 400 and stored.json()["error"]["code"] == "unsupported_field"
    ids = post(url, "/detokenize", {"model": MODEL, "tokens": ["a"]})
    assert ids.status_code == 400 and ids.json()["error"]["param"] == "tokens"
    # The request rate holds on the tokenizer's routes too (a bucket of one).
    slow = [post(url, "/tokenize", {"model": MODEL, "prompt": "x"}, "fi_slow") for _ in range(2)]
    assert [r.status_code for r in slow] == [200, 429] and "retry-after" in slow[1].headers


def test_residency_holds_on_every_route(fed: Fed) -> None:
    for path, extra in ROUTES:
        if path == "/detokenize":
            extra = {"tokens": []}
        resp = post(fed.r1.url, path, {"model": MODEL, **extra}, "fi_us")
        assert resp.status_code == 200, (path, resp.text)
        route = route_of(resp.headers)
        assert route["region"] == "r2" and route["remote_from"] == "r1", path
        assert route["spill"] == "residency" and route["instance"] in fed.r2_engines, path
        # An EU-only tenant is served in r1 only, whatever r2 could do.
        eu = post(fed.r1.url, path, {"model": MODEL, **extra}, "fi_eu")
        assert route_of(eu.headers)["region"] == "r1", path


def test_a_tokenizer_call_takes_no_slot(fed: Fed) -> None:
    """Both r1 instances busy at their cap of one, no gateway queue: a chat is refused as
    saturated, the tokenizer still answers at once."""
    started = threading.Barrier(3)

    def hold() -> None:
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": f"hold {threading.get_ident()}"}],
            "max_tokens": 400,
            "ignore_eos": True,
            "stream": True,
        }
        headers = {"Authorization": "Bearer fi_eu"}
        with httpx.stream(
            "POST", fed.r1.url + "/v1/chat/completions", json=body, headers=headers, timeout=60
        ) as resp:
            lines = resp.iter_lines()
            next(lines)
            started.wait()
            for _ in lines:
                pass

    holders = [threading.Thread(target=hold) for _ in range(2)]
    for t in holders:
        t.start()
    try:
        started.wait(timeout=30)
        chat = post(
            fed.r1.url,
            "/v1/chat/completions",
            {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        )
        assert chat.status_code == 503 and chat.json()["error"]["code"] == "saturated"
        t0 = time.perf_counter()
        tok = post(fed.r1.url, "/tokenize", {"model": MODEL, "prompt": "still answered"})
        assert tok.status_code == 200 and time.perf_counter() - t0 < 1.0
        assert route_of(tok.headers)["policy_reason"] == "unqueued"
    finally:
        for t in holders:
            t.join(timeout=60)


def test_responses_stream_is_relayed_faithfully_and_metered_from_response_completed(
    fed: Fed,
) -> None:
    since = time.time()
    body = {"model": MODEL, "input": "Tell me about prefixes.", "max_output_tokens": 20}
    whole = post(fed.r1.url, "/v1/responses", body)
    streamed = post(fed.r1.url, "/v1/responses", {**body, "stream": True})
    assert streamed.status_code == 200
    assert streamed.headers["content-type"].startswith("text/event-stream")
    assert route_of(streamed.headers)["region"] == "r1"
    events = sse_events(streamed.content)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[0]["type"] == "response.created" and events[-1]["type"] == "response.completed"
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert deltas == whole.json()["output"][0]["content"][0]["text"]
    assert b"[DONE]" not in streamed.content  # nothing added, nothing stripped
    embed = post(fed.r1.url, "/v1/embeddings", {"model": MODEL, "input": ["a b c", "d e"]})
    rerank = post(fed.r1.url, "/rerank", {"model": MODEL, "query": "q", "documents": ["x", "y"]})
    tok = post(fed.r1.url, "/tokenize", {"model": MODEL, "prompt": "not metered"})
    assert tok.status_code == 200
    # Four records: the tokenizer's call reports no usage and is not metered.
    metered = wait_records(fed.stream, 4, since)
    usage = whole.json()["usage"]
    final = events[-1]["response"]["usage"]
    # Same prompt, same answer (the simulator is deterministic); only the cache hit differs.
    assert (final["input_tokens"], final["output_tokens"]) == (
        usage["input_tokens"],
        usage["output_tokens"],
    )
    [stream_rec] = [r for r in metered if r.streamed]
    assert (stream_rec.prompt_tokens, stream_rec.completion_tokens) == (
        final["input_tokens"],
        final["output_tokens"],
    )
    assert stream_rec.usage_reported and stream_rec.ttft_ms is not None
    pooled = sorted((r for r in metered if r.completion_tokens == 0), key=lambda r: r.prompt_tokens)
    expected = sorted(
        [embed.json()["usage"]["prompt_tokens"], rerank.json()["usage"]["total_tokens"]]
    )
    assert [r.prompt_tokens for r in pooled] == expected
    assert all(r.usage_reported and r.tenant == "eu" and r.region == "r1" for r in pooled)
    [whole_rec] = [r for r in metered if not r.streamed and r.completion_tokens]
    assert (whole_rec.prompt_tokens, whole_rec.completion_tokens) == (
        usage["input_tokens"],
        usage["output_tokens"],
    )


def test_a_responses_stream_cut_mid_way_ends_with_an_error_event(fed: Fed) -> None:
    """The engine dies after three tokens: the client gets what was relayed and a Responses
    ``error`` event (not a chat-style one), and the usage record charges the relayed deltas."""
    since = time.time()
    faults = [url + "/admin/faults" for url in fed.r1_engines.values()]
    try:
        for url in faults:
            assert httpx.post(url, json={"die_after_tokens": 3}, timeout=5).status_code == 200
        body = {"model": MODEL, "input": "cut me", "max_output_tokens": 20, "ignore_eos": True}
        resp = post(fed.r1.url, "/v1/responses", {**body, "stream": True})
    finally:
        for url in faults:
            httpx.post(url, json={"reset": True}, timeout=5)
    assert resp.status_code == 200
    events = sse_events(resp.content)
    kinds = [e["type"] for e in events]
    assert kinds[0] == "response.created" and kinds.count("response.output_text.delta") == 3
    error = events[-1]
    assert error["type"] == "error" and error["code"] == "upstream_stream_cut"
    assert error["sequence_number"] == len(events) - 1 == events[-2]["sequence_number"] + 1
    [cut] = wait_records(fed.stream, 1, since)
    assert (cut.status, cut.usage_reported, cut.completion_tokens) == (502, False, 3)
