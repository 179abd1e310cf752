"""The simulator's Responses, pooling and tokenizer routes, driven in-process through ASGI."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from regions.engines.simulator.engine import SimEngine
from regions.engines.simulator.server import EngineApp
from tests.unit.test_sim_server import FIXTURES, call, needs_captures, with_engine

MODEL = "tiny-llama"


def sse_events(body: bytes) -> list[tuple[str, dict[str, Any]]]:
    """``event: <type>`` / ``data: {...}`` blocks, as the Responses API streams them."""
    out = []
    for block in body.decode().split("\n\n"):
        if not block:
            continue
        head, data = block.split("\n", 1)
        assert head.startswith("event: ") and data.startswith("data: "), block
        doc = json.loads(data[len("data: ") :])
        assert doc["type"] == head[len("event: ") :]
        out.append((doc["type"], doc))
    return out


def test_tokenize_and_detokenize_round_trip_and_count_like_completions() -> None:
    async def check(app: EngineApp, engine: SimEngine) -> None:
        text = "Route the request to the engine that holds the prefix."
        tok = await call(app, "POST", "/tokenize", {"model": MODEL, "prompt": text})
        assert tok.status == 200
        doc = tok.json()
        assert list(doc) == ["count", "max_model_len", "tokens", "token_strs"]
        assert doc["count"] == len(doc["tokens"]) and doc["max_model_len"] == 1024
        back = await call(app, "POST", "/detokenize", {"model": MODEL, "tokens": doc["tokens"]})
        assert back.status == 200 and back.json() == {"prompt": text}
        done = await call(
            app, "POST", "/v1/completions", {"model": MODEL, "prompt": text, "max_tokens": 2}
        )
        assert done.json()["usage"]["prompt_tokens"] == doc["count"]
        unknown = await call(app, "POST", "/detokenize", {"model": MODEL, "tokens": [7]})
        assert unknown.status == 400 and "out of vocabulary" in unknown.json()["error"]["message"]
        missing = await call(app, "POST", "/tokenize", {"model": "nope", "prompt": "x"})
        assert missing.status == 404

    with_engine(check)


def test_embeddings_batch_are_deterministic_with_prompt_usage() -> None:
    async def check(app: EngineApp, engine: SimEngine) -> None:
        inputs = ["first text to embed", "a second, longer text to embed here"]
        resp = await call(app, "POST", "/v1/embeddings", {"model": MODEL, "input": inputs})
        assert resp.status == 200
        doc = resp.json()
        assert [k for k in doc] == ["id", "object", "created", "model", "data", "usage"]
        assert doc["id"].startswith("embd-") and doc["object"] == "list"
        assert [d["index"] for d in doc["data"]] == [0, 1]
        assert all(d["object"] == "embedding" and len(d["embedding"]) == 64 for d in doc["data"])
        counts = [
            (await call(app, "POST", "/tokenize", {"model": MODEL, "prompt": t})).json()["count"]
            for t in inputs
        ]
        assert doc["usage"]["prompt_tokens"] == sum(counts) == doc["usage"]["total_tokens"]
        assert doc["usage"]["completion_tokens"] == 0
        again = await call(
            app, "POST", "/v1/embeddings", {"model": MODEL, "input": inputs[1], "dimensions": 8}
        )
        vec = again.json()["data"][0]["embedding"]
        assert len(vec) == 8 and abs(sum(x * x for x in vec) - 1.0) < 1e-9

    with_engine(check)


def test_pooling_routes_answer_in_vllm_shapes() -> None:
    async def check(app: EngineApp, engine: SimEngine) -> None:
        docs = ["alpha beta", "gamma delta epsilon", "zeta"]
        rerank = await call(
            app,
            "POST",
            "/v1/rerank",
            {"model": MODEL, "query": "which one", "documents": docs, "top_n": 2},
        )
        assert rerank.status == 200
        body = rerank.json()
        assert list(body) == ["id", "model", "usage", "results"]
        scores = [r["relevance_score"] for r in body["results"]]
        assert len(scores) == 2 and scores == sorted(scores, reverse=True)
        assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] > 0
        score = await call(
            app, "POST", "/score", {"model": MODEL, "text_1": "which one", "text_2": docs}
        )
        assert [d["object"] for d in score.json()["data"]] == ["score"] * 3
        classify = await call(app, "POST", "/classify", {"model": MODEL, "input": docs})
        assert [d["num_classes"] for d in classify.json()["data"]] == [2, 2, 2]
        pooling = await call(app, "POST", "/pooling", {"model": MODEL, "input": "alpha"})
        assert pooling.json()["data"][0]["object"] == "pooling"

    with_engine(check)


def test_responses_whole_and_streamed_agree_with_usage_at_the_end() -> None:
    async def check(app: EngineApp, engine: SimEngine) -> None:
        request = {
            "model": MODEL,
            "instructions": "Answer briefly.",
            "input": "Which engine holds the prefix?",
            "max_output_tokens": 12,
        }
        whole = await call(app, "POST", "/v1/responses", request)
        assert whole.status == 200
        doc = whole.json()
        assert doc["object"] == "response" and doc["id"].startswith("resp_")
        text = doc["output"][0]["content"][0]["text"]
        usage = doc["usage"]
        assert usage["output_tokens"] <= 12 and usage["input_tokens"] > 0
        assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
        streamed = await call(app, "POST", "/v1/responses", {**request, "stream": True})
        assert streamed.headers["content-type"].startswith("text/event-stream")
        events = sse_events(streamed.body)
        kinds = [k for k, _ in events]
        deltas = [e["delta"] for k, e in events if k == "response.output_text.delta"]
        assert kinds[:4] == [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.content_part.added",
        ]
        assert kinds[4 : 4 + len(deltas)] == ["response.output_text.delta"] * len(deltas)
        assert kinds[4 + len(deltas) :] == [
            "response.output_text.done",
            "response.content_part.done",
            "response.output_item.done",
            "response.completed",
        ]
        assert [e["sequence_number"] for _, e in events] == list(range(len(events)))
        assert "".join(deltas) == text  # same prompt, same answer
        final = events[-1][1]["response"]
        assert final["usage"]["output_tokens"] == len(deltas) == usage["output_tokens"]
        assert b"[DONE]" not in streamed.body

    with_engine(check)
    with_engine(check, zero_latency=True)


def first_shape(value: Any) -> Any:
    """The structure of a JSON value (keys in order, value kinds; a list by its first item)."""
    if isinstance(value, dict):
        return [(k, first_shape(v)) for k, v in value.items()]
    if isinstance(value, list):
        return [first_shape(v) for v in value[:1]]
    if value is None:
        return None
    return "number" if isinstance(value, int | float) else type(value).__name__


@needs_captures
@pytest.mark.parametrize(
    "name",
    [
        "responses.json",
        "tokenize.json",
        "detokenize.json",
        "embeddings.json",
        "pooling.json",
        "score.json",
        "rerank.json",
    ],
)
def test_route_answers_have_the_shape_of_real_vllm(name: str) -> None:
    entry = json.loads((FIXTURES / "index.json").read_text())[name]
    real = json.loads((FIXTURES / name).read_bytes())
    request = dict(entry["request"]["json"])
    if name == "responses.json":
        request["ignore_eos"] = True  # stops at max_output_tokens, as the capture did
    if name == "detokenize.json":
        request["tokens"] = []  # the real tokenizer's ids mean nothing to the simulator

    async def check(app: EngineApp, engine: SimEngine) -> None:
        ours = await call(app, "POST", entry["request"]["path"], request)
        assert ours.status == entry["status"]
        assert first_shape(ours.json()) == first_shape(real)

    with_engine(check)


@needs_captures
def test_responses_stream_has_the_events_of_real_vllm() -> None:
    entry = json.loads((FIXTURES / "index.json").read_text())["responses_stream.txt"]
    real = sse_events((FIXTURES / "responses_stream.txt").read_bytes())

    async def check(app: EngineApp, engine: SimEngine) -> None:
        body = {**entry["request"]["json"], "ignore_eos": True}
        ours = sse_events((await call(app, "POST", "/v1/responses", body)).body)
        # Real deltas are detokenizer steps, not one per token: compare each kind once.
        assert list(dict.fromkeys(k for k, _ in ours)) == list(dict.fromkeys(k for k, _ in real))
        shapes = {k: first_shape(e) for k, e in real}
        assert {k: first_shape(e) for k, e in ours} == shapes

    with_engine(check)


def test_a_client_that_leaves_aborts_its_pooling_requests() -> None:
    async def check(app: EngineApp, engine: SimEngine) -> None:
        inputs = ["a long document to embed " * 150 for _ in range(48)]
        r = await call(
            app,
            "POST",
            "/v1/embeddings",
            {"model": MODEL, "input": inputs},
            disconnect_after_bodies=0,
        )
        assert r.status == 0  # nobody left to answer
        await asyncio.sleep(0.02)
        assert engine.kv.usage == 0.0 and not engine.scheduler.has_work()
        aborted = (
            'vllm:request_success_total{engine="0",finished_reason="abort",'
            'model_name="tiny-llama"} 48.0'
        )
        assert aborted in engine.metrics_text().decode().splitlines()

    with_engine(check)
