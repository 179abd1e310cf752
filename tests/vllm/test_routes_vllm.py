"""The routes beyond completions against real vLLM (CPU build) servers, through ``fedinfer
edge`` and directly (``make test-vllm``): the tokenizer's, the Responses API (whole and
streamed) and, on a ``--runner pooling`` server, embeddings, pooling, score and rerank. Through
the edge, each answer equals the server's own, ids and timestamps aside."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.vllm.servers import (
    EDGE_REGION,
    KV_BLOCK_SIZE,
    MAX_NUM_SEQS,
    POOLING_MODEL,
    SERVED_MODEL,
    EdgeProcess,
    VllmServer,
    routing_table,
    start_edge,
)

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

#: Keys whose values differ between two calls of the same request.
_VOLATILE = {
    "id",
    "created",
    "created_at",
    "item_id",
    "sequence_number",
    "cached_tokens",
    "cached_tokens_per_turn",
}


@pytest.fixture(scope="module")
def routes_edge(
    vllm_pair: tuple[VllmServer, VllmServer],
    vllm_pooling: VllmServer,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[EdgeProcess]:
    """An edge in front of the two generating servers and the pooling one."""
    table = routing_table(vllm_pair)
    table["instances"] = [  # type: ignore[index]
        *table["instances"],  # type: ignore[misc]
        {
            "id": vllm_pooling.name,
            "url": vllm_pooling.base_url,
            "model": POOLING_MODEL,
            "accelerator": "cpu",
            "tp": 1,
            "max_concurrency": MAX_NUM_SEQS,
            "prefill_tokens_per_s": 4500.0,
            "kv_block_tokens": KV_BLOCK_SIZE,
        },
    ]
    path = tmp_path_factory.mktemp("routes-edge") / "table.json"
    path.write_text(json.dumps(table))
    timeouts = ("--scrape-timeout", "10", "--probe-timeout", "10")
    edge = start_edge("edge-routes", path, "--region", EDGE_REGION, *timeouts, healthy_instances=3)
    try:
        yield edge
    finally:
        edge.stop()


def comparable(doc: Any, computed: bool = False) -> Any:
    """``doc`` without its volatile fields; with ``computed``, its floats as ``approx`` (the
    float32 engine's pooling outputs differ in the last bits between two runs of the same
    request: which prefix blocks were cached changes the order of the sums, seen as 2.5e-7
    apart on a rerank score)."""
    if isinstance(doc, dict):
        return {k: comparable(v, computed) for k, v in doc.items() if k not in _VOLATILE}
    if isinstance(doc, list):
        return [comparable(v, computed) for v in doc]
    if computed and isinstance(doc, float):
        return pytest.approx(doc, rel=1e-5, abs=1e-6)
    return doc


def via_edge_and_direct(
    edge: EdgeProcess, servers: dict[str, VllmServer], path: str, body: dict[str, Any]
) -> tuple[httpx.Response, httpx.Response, dict[str, str]]:
    """The edge's answer, the route it took, and the same request sent to that server."""
    via = httpx.post(edge.base_url + path, json=body, timeout=120)
    assert via.status_code == 200, (path, via.text)
    header = via.headers["x-fedinfer-route"]
    route = dict(part.split("=", 1) for part in header.split(";"))
    direct = httpx.post(servers[route["instance"]].base_url + path, json=body, timeout=120)
    assert direct.status_code == 200, (path, direct.text)
    return via, direct, route


def sse_events(body: bytes) -> list[dict[str, Any]]:
    out = []
    for block in body.decode().split("\n\n"):
        if block:
            head, data = block.split("\n", 1)
            doc = json.loads(data[len("data: ") :])
            assert head == f"event: {doc['type']}"
            out.append(doc)
    return out


def delta(event: dict[str, Any]) -> bool:
    return bool(event["type"] == "response.output_text.delta")


def text_of(events: list[dict[str, Any]]) -> str:
    return "".join(e["delta"] for e in events if delta(e))


def via_text(events: list[dict[str, Any]]) -> str:
    """The whole text as the stream's final response states it."""
    return str(events[-1]["response"]["output"][0]["content"][0]["text"])


def test_tokenizer_routes_through_the_edge_equal_the_servers(
    routes_edge: EdgeProcess, vllm_pair: tuple[VllmServer, VllmServer]
) -> None:
    servers = {s.name: s for s in vllm_pair}
    text = "The edge routes every request to the engine that holds its prefix."
    bodies = [
        ("/tokenize", {"model": SERVED_MODEL, "prompt": text, "return_token_strs": True}),
        (
            "/tokenize",
            {"model": SERVED_MODEL, "messages": [{"role": "user", "content": text}]},
        ),
    ]
    tokens: list[int] = []
    for path, body in bodies:
        via, direct, route = via_edge_and_direct(routes_edge, servers, path, body)
        assert via.content == direct.content  # byte for byte
        assert route["policy_reason"] == "unqueued" and route["region"] == EDGE_REGION
        tokens = tokens or via.json()["tokens"]
    via, direct, _ = via_edge_and_direct(
        routes_edge, servers, "/detokenize", {"model": SERVED_MODEL, "tokens": tokens}
    )
    assert via.content == direct.content and text in via.json()["prompt"]


def test_responses_through_the_edge_equal_the_servers(
    routes_edge: EdgeProcess, vllm_pair: tuple[VllmServer, VllmServer]
) -> None:
    servers = {s.name: s for s in vllm_pair}
    body = {
        "model": SERVED_MODEL,
        "instructions": "Answer in a few words.",
        "input": "Which engine holds the prefix?",
        "max_output_tokens": 8,
        "temperature": 0,
    }
    via, direct, route = via_edge_and_direct(routes_edge, servers, "/v1/responses", body)
    assert route["policy_reason"] == "best_ttft"
    assert comparable(via.json()) == comparable(direct.json())
    usage = via.json()["usage"]
    assert usage["output_tokens"] == 8 and usage["input_tokens"] > 0

    t0 = time.perf_counter()
    via, direct, route = via_edge_and_direct(
        routes_edge, servers, "/v1/responses", {**body, "stream": True}
    )
    assert via.headers["content-type"].startswith("text/event-stream")
    ours, theirs = sse_events(via.content), sse_events(direct.content)
    # How the detokenizer cuts the text into deltas is the server's timing; the text is not.
    for events in (ours, theirs):
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert text_of(ours) == text_of(theirs) == via_text(ours)
    assert [comparable(e) for e in ours if not delta(e)] == [
        comparable(e) for e in theirs if not delta(e)
    ]
    assert ours[-1]["type"] == "response.completed"
    assert ours[-1]["response"]["usage"]["output_tokens"] == 8
    assert b"[DONE]" not in via.content  # nothing added to the stream, nothing stripped
    timing = via.headers["server-timing"]
    assert "ttft;dur=" in timing and time.perf_counter() - t0 < 120


def test_pooling_routes_through_the_edge_equal_the_server(
    routes_edge: EdgeProcess, vllm_pooling: VllmServer
) -> None:
    servers = {vllm_pooling.name: vllm_pooling}
    cases = [
        ("/v1/embeddings", {"input": ["route the request", "to the engine"]}),
        ("/pooling", {"input": "hold the prefix"}),
        ("/score", {"text_1": "prefix cache", "text_2": ["engine", "edge router"]}),
        ("/v1/rerank", {"query": "prefix cache", "documents": ["engine", "edge", "queue"]}),
    ]
    for path, extra in cases:
        body = {"model": POOLING_MODEL, **extra}
        via, direct, route = via_edge_and_direct(routes_edge, servers, path, body)
        assert route["instance"] == vllm_pooling.name and route["policy_reason"] == "best_ttft"
        # Prefill only: nothing cached is predicted for a pooling request.
        assert ",cached:0," in route["score"], route
        assert comparable(via.json()) == comparable(direct.json(), computed=True), path
        usage = via.json()["usage"]
        assert usage["total_tokens"] == usage["prompt_tokens"] > 0, path
    # The generating servers do not serve the pooling routes: vLLM's 404 is passed through.
    wrong = httpx.post(
        routes_edge.base_url + "/v1/embeddings",
        json={"model": SERVED_MODEL, "input": "x"},
        timeout=60,
    )
    assert wrong.status_code == 404
