"""Two real vLLM (CPU build) servers, directly and behind ``fedinfer edge`` (``make test-vllm``).

What the simulator cannot prove: the real server's protocol (the captures in
``tests/fixtures/vllm`` still match it), our metrics parser against its live ``/metrics``, the
official ``openai`` SDK through the edge, the edge's load view coming from the engines' real
``/metrics``, and prefix-cache locality visible in vLLM's own ``cached_tokens``.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from regions.engines.metrics import EngineLoad, parse_vllm_metrics
from tests.vllm.capture_fixtures import shared_prefix
from tests.vllm.servers import (
    KV_BLOCK_SIZE,
    MAX_MODEL_LEN,
    SERVED_MODEL,
    EdgeProcess,
    VllmServer,
)

# Starting two servers on 2 shared cores takes 1-4 min (inside the first test's setup).
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "vllm"


def long_prefix(tag: str, words: int = 300) -> str:
    """A system prompt of ~470 tokens (3 full KV blocks of 128), unique per ``tag``."""
    return f"[{tag}] {shared_prefix(words)}"


def chat(system: str | None, user: str, **extra: Any) -> dict[str, Any]:
    messages = [{"role": "user", "content": user}]
    if system is not None:
        messages.insert(0, {"role": "system", "content": system})
    return {
        "model": SERVED_MODEL,
        "messages": messages,
        "max_tokens": 8,
        "temperature": 0,
        "ignore_eos": True,
        **extra,
    }


def post_chat(base_url: str, body: dict[str, Any]) -> dict[str, Any]:
    resp = httpx.post(base_url + "/v1/chat/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    return dict(resp.json())


def cached_tokens(response: dict[str, Any]) -> int:
    return int(response["usage"]["prompt_tokens_details"]["cached_tokens"])


def scrape(server: VllmServer) -> EngineLoad:
    resp = httpx.get(server.base_url + "/metrics", timeout=10)
    resp.raise_for_status()
    return parse_vllm_metrics(resp.text)


def wait_for(
    predicate: Callable[[], bool],
    timeout_s: float,
    what: str,
    explain: Callable[[], str] | None = None,
) -> None:
    """Poll ``predicate``; on timeout say what was awaited and, with ``explain``, what was seen."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            seen = f"; last seen: {explain()}" if explain is not None else ""
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}{seen}")
        time.sleep(0.1)


def route_of(header: str | None) -> dict[str, str]:
    """``x-fedinfer-route`` → {region, instance, policy_reason, score, runner_up, retries}."""
    assert header, "response has no x-fedinfer-route header"
    return dict(part.split("=", 1) for part in header.split(";"))


def score_terms(route: dict[str, str]) -> dict[str, float]:
    return {k: float(v) for k, v in (t.split(":", 1) for t in route["score"].split(","))}


def shape(value: Any) -> Any:
    """The JSON structure without the values that change per request (ids, times, text)."""
    if isinstance(value, dict):
        return {k: shape(v) for k, v in value.items()}
    if isinstance(value, list):
        return [shape(v) for v in value[:1]]
    return type(value).__name__


# ------------------------------------------------------------------ the servers themselves


def test_both_servers_serve_the_tiny_model(vllm_pair: tuple[VllmServer, VllmServer]) -> None:
    for server in vllm_pair:
        assert httpx.get(server.base_url + "/health", timeout=10).status_code == 200
        models = httpx.get(server.base_url + "/v1/models", timeout=10).json()
        assert [(m["id"], m["max_model_len"]) for m in models["data"]] == [
            (SERVED_MODEL, MAX_MODEL_LEN)
        ]


def test_captured_fixtures_still_match_the_live_server(
    vllm_pair: tuple[VllmServer, VllmServer],
) -> None:
    """The simulator and the edge test against tests/fixtures/vllm: keep them true."""
    server = vllm_pair[0]
    index = json.loads((FIXTURES / "index.json").read_text())
    for name in (
        "models.json",
        "chat.json",
        "completion.json",
        "error_unknown_model.json",
        "error_context_overflow.json",
        "error_context_overflow_chars.json",
        "error_missing_messages.json",
    ):
        req = index[name]["request"]
        live = httpx.request(
            req["method"], server.base_url + req["path"], json=req["json"], timeout=120
        )
        assert live.status_code == index[name]["status"], (name, live.text)
        assert live.headers.get("content-type") == index[name]["content_type"], name
        captured = json.loads((FIXTURES / name).read_bytes())
        if name.startswith("error_"):
            assert live.json() == captured, name  # errors are deterministic, byte for byte
        else:
            assert shape(live.json()) == shape(captured), name
    stream = httpx.post(
        server.base_url + "/v1/chat/completions",
        json=index["chat_stream.txt"]["request"]["json"],
        timeout=120,
    )
    events = [e for e in stream.text.split("\n\n") if e]
    captured_events = [e for e in (FIXTURES / "chat_stream.txt").read_text().split("\n\n") if e]
    assert events[-1] == captured_events[-1] == "data: [DONE]"
    live_docs = [json.loads(e[6:]) for e in events[:-1]]
    captured_docs = [json.loads(e[6:]) for e in captured_events[:-1]]
    # vLLM merges the deltas a slow reader has not taken yet into one event (its output
    # collector), so a loaded CPU server sends fewer, longer content events than the capture:
    # what holds is the role event first, content events of the captured shapes, the final
    # usage event, and the same number of tokens in all.
    assert shape(live_docs[0]) == shape(captured_docs[0])
    assert shape(live_docs[-1]) == shape(captured_docs[-1])
    assert (
        live_docs[-1]["usage"]["completion_tokens"]
        == captured_docs[-1]["usage"]["completion_tokens"]
    )
    content_shapes = [shape(d) for d in captured_docs[1:-1]]
    assert 1 <= len(live_docs) - 2 <= len(content_shapes)
    assert all(shape(d) in content_shapes for d in live_docs[1:-1])
    assert live_docs[-2]["choices"][0]["finish_reason"] == "length"


def test_metrics_parser_reads_the_live_metrics(vllm_pair: tuple[VllmServer, VllmServer]) -> None:
    server = vllm_pair[1]
    before = scrape(server)
    assert before.block_size == KV_BLOCK_SIZE
    assert before.model_names == (SERVED_MODEL,)
    assert 0.0 <= before.kv_cache_usage_perc <= 1.0
    assert before.num_gpu_blocks is not None and before.num_gpu_blocks > 0

    answer = post_chat(server.base_url, chat(None, "count the tokens of this request"))
    usage = answer["usage"]

    def counted() -> bool:
        now = scrape(server)
        return (
            now.prompt_tokens_total - before.prompt_tokens_total == usage["prompt_tokens"]
            and now.generation_tokens_total - before.generation_tokens_total
            == usage["completion_tokens"]
            and now.request_success_total - before.request_success_total == 1
        )

    wait_for(counted, 10, "the request's tokens in vllm:*_tokens_total")


def test_repeated_prefix_is_cached_on_that_server_only(
    vllm_pair: tuple[VllmServer, VllmServer],
) -> None:
    holder, other = vllm_pair
    system = long_prefix("direct")
    first = post_chat(holder.base_url, chat(system, "first question"))
    assert first["usage"]["prompt_tokens"] >= 2 * KV_BLOCK_SIZE + 100
    assert cached_tokens(first) == 0
    hits_before = scrape(holder).prefix_cache_hits_total

    second = post_chat(holder.base_url, chat(system, "second question"))
    assert cached_tokens(second) >= 2 * KV_BLOCK_SIZE
    assert cached_tokens(second) % KV_BLOCK_SIZE == 0  # only full blocks are cached
    wait_for(
        lambda: scrape(holder).prefix_cache_hits_total - hits_before >= cached_tokens(second),
        10,
        "vllm:prefix_cache_hits_total to count the hit",
    )
    elsewhere = post_chat(other.base_url, chat(system, "second question"))
    assert cached_tokens(elsewhere) == 0


# ------------------------------------------------------------------ through the edge


@pytest.fixture(scope="module")
def sdk(edge: EdgeProcess) -> Iterator[openai.OpenAI]:
    client = openai.OpenAI(base_url=edge.base_url + "/v1", api_key="not-checked", max_retries=0)
    yield client
    client.close()


def edge_metric(edge: EdgeProcess, name: str) -> float:
    """Sum of every sample of ``name`` in the edge's own /metrics."""
    text = httpx.get(edge.ops_url + "/metrics", timeout=10).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_openai_sdk_through_the_edge(
    sdk: openai.OpenAI, vllm_pair: tuple[VllmServer, VllmServer]
) -> None:
    names = {s.name for s in vllm_pair}
    raw = sdk.chat.completions.with_raw_response.create(
        model=SERVED_MODEL,
        messages=[{"role": "user", "content": "Say hello through the edge."}],
        max_tokens=8,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    route = route_of(raw.headers.get("x-fedinfer-route"))
    assert route["region"] == "cpu-lab"
    assert route["instance"] in names
    assert route["retries"] == "0"
    assert "ttft;dur=" in raw.headers["server-timing"]
    completion = raw.parse()
    assert completion.model == SERVED_MODEL
    assert completion.choices[0].finish_reason == "length"
    assert completion.usage is not None
    assert completion.usage.completion_tokens == 8
    assert completion.usage.prompt_tokens_details is not None

    text = sdk.completions.create(
        model=SERVED_MODEL, prompt="The edge routes", max_tokens=5, extra_body={"ignore_eos": True}
    )
    assert text.usage is not None and text.usage.completion_tokens == 5

    with pytest.raises(openai.NotFoundError):
        sdk.chat.completions.create(
            model="no-such-model", messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )


def test_openai_sdk_streaming_through_the_edge(
    sdk: openai.OpenAI, vllm_pair: tuple[VllmServer, VllmServer]
) -> None:
    with sdk.chat.completions.with_streaming_response.create(
        model=SERVED_MODEL,
        messages=[{"role": "user", "content": "Stream through the edge."}],
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    ) as response:
        route = route_of(response.headers.get("x-fedinfer-route"))
        assert route["instance"] in {s.name for s in vllm_pair}
        assert response.headers["content-type"].startswith("text/event-stream")
        chunks = list(response.parse())
    content_chunks = [c for c in chunks if c.choices and c.choices[0].delta.content is not None]
    assert len(content_chunks) >= 2
    assert chunks[-1].choices == []
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == 12
    finals = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finals[-1] == "length"


def load_views(edge: EdgeProcess, servers: tuple[VllmServer, ...]) -> str:
    """The edge's view of each server next to the server's own /metrics (for a failure)."""
    detail = httpx.get(edge.ops_url + "/healthz", timeout=10).json()["detail"]
    views = []
    for server in servers:
        engine = scrape(server)
        views.append(
            f"{server.name}: edge {detail[server.name]}, engine running "
            f"{engine.num_requests_running} waiting {engine.num_requests_waiting}"
        )
    return "; ".join(views)


def edge_outstanding(edge: EdgeProcess, instance: str) -> int:
    """Requests the edge believes ``instance`` has (its ``/healthz`` view of the scrapes)."""
    try:
        resp = httpx.get(edge.ops_url + "/healthz", timeout=10)
    except httpx.TransportError as exc:
        # Say what the edge was doing: whether it still runs, and the end of its log.
        raise AssertionError(
            f"/healthz of the edge failed: {exc!r}; edge exit code {edge.proc.poll()}; "
            f"its log ends:\n{edge.proc.tail(20)}"
        ) from exc
    resp.raise_for_status()
    return int(resp.json()["detail"][instance]["outstanding"])


@contextmanager
def held_load(server: VllmServer, requests: int) -> Iterator[int]:
    """``requests`` generations sent to ``server`` directly, held running in its engine.

    Once they all run, vLLM's ``/pause?mode=keep`` (dev mode) freezes them in place: the
    engine keeps them as running requests and its ``/metrics`` keeps reporting them, whatever
    the speed of the machine. (Generations left to run on a CPU server come and go in
    between, and were read as idle whenever all of them had just ended.) Yields the running
    count the frozen engine reports; ``/resume`` lets them finish, and each must succeed."""
    answers: list[tuple[int, float, str]] = []  # status, seconds after the start, body's start
    errors: list[BaseException] = []
    started = time.monotonic()

    def generate(i: int) -> None:
        try:
            # As long as the context allows (~8 s at 8 ms a token here, longer under load): a
            # busy CPU server took its requests in up to 3 s apart, and 400 tokens (3.4 s)
            # had the first ended before the last began, so all four never ran at once.
            body = chat(None, f"held {i}", max_tokens=MAX_MODEL_LEN - 64)
            resp = httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=300)
            answers.append((resp.status_code, time.monotonic() - started, resp.text[:200]))
        except BaseException as exc:
            errors.append(exc)

    def seen() -> str:
        return (
            f"{scrape(server)}; answers {answers!r}; errors {errors!r}; "
            f"{server.name}'s log ends:\n{server.proc.tail(30)}"
        )

    threads = [threading.Thread(target=generate, args=(i,)) for i in range(requests)]
    for thread in threads:
        thread.start()
    paused = False
    try:
        wait_for(
            lambda: (
                scrape(server).num_requests_running >= requests
                or not any(thread.is_alive() for thread in threads)
            ),
            60,
            f"{requests} requests running on {server.name}",
            seen,
        )
        assert scrape(server).num_requests_running >= requests, f"all ended first: {seen()}"
        pause = httpx.post(server.base_url + "/pause", params={"mode": "keep"}, timeout=30)
        assert pause.status_code == 200, pause.text
        paused = True
        frozen = scrape(server)
        assert frozen.num_requests_running >= 1, frozen
        yield frozen.num_requests_running
    finally:
        if paused:
            httpx.post(server.base_url + "/resume", timeout=30).raise_for_status()
        for thread in threads:
            thread.join(timeout=300)
    assert not errors, errors
    assert [status for status, _, _ in answers] == [200] * requests, answers


def test_edge_routes_on_the_engines_real_metrics(
    edge: EdgeProcess, vllm_pair: tuple[VllmServer, VllmServer]
) -> None:
    """Load the edge never saw (sent to one server directly) steers its choice to the other."""
    busy, idle = vllm_pair
    with held_load(busy, requests=4) as running:
        # The edge sent the busy server nothing: it knows the load only from its scrapes.
        wait_for(
            lambda: (
                edge_outstanding(edge, busy.name) == running
                and edge_outstanding(edge, idle.name) == 0
            ),
            30,
            f"the edge reading {running} requests on {busy.name} and none on {idle.name}",
            lambda: load_views(edge, vllm_pair),
        )
        routes = []
        for i in range(4):
            try:
                resp = httpx.post(
                    edge.base_url + "/v1/chat/completions",
                    json=chat(None, f"while {busy.name} is busy, request {i}"),
                    timeout=60,
                )
            except httpx.ReadTimeout as exc:
                # Only the paused server holds an answer back this long.
                views = load_views(edge, vllm_pair)
                raise AssertionError(
                    f"request {i} was sent to the paused {busy.name}: {views}"
                ) from exc
            assert resp.status_code == 200, resp.text
            routes.append(route_of(resp.headers.get("x-fedinfer-route")))
    # Every request goes to the idle server, the busy one runner-up and slower by its scraped
    # load alone: the prompts are shorter than a block, so nothing is cached on either side.
    # Without the scrapes the two would tie, and ties rotate between them.
    for r in routes:
        assert r["instance"] == idle.name, routes
        runner_up, runner_up_ttft = r["runner_up"].split(":")
        assert runner_up == busy.name, routes
        assert float(runner_up_ttft) > score_terms(r)["ttft_ms"], routes
        assert score_terms(r)["cached"] == 0, routes


def test_repeated_prefix_lands_on_the_server_that_holds_it(
    edge: EdgeProcess, vllm_pair: tuple[VllmServer, VllmServer]
) -> None:
    actual_before = edge_metric(edge, "fedinfer_edge_actual_cached_tokens_total")
    placements: dict[str, str] = {}
    for tag in ("alpha", "beta", "gamma", "delta"):
        system = long_prefix("edge-" + tag)
        turns = []
        for question in ("first turn", "second turn", "third turn"):
            resp = httpx.post(
                edge.base_url + "/v1/chat/completions",
                json=chat(system, f"{tag}: {question}"),
                timeout=60,
            )
            assert resp.status_code == 200, resp.text
            turns.append((route_of(resp.headers.get("x-fedinfer-route")), resp.json()))
        (first_route, first), *later = turns
        holder = first_route["instance"]
        placements[tag] = holder
        assert cached_tokens(first) == 0, (tag, first["usage"])
        for route, answer in later:
            assert route["instance"] == holder, (tag, [r for r, _ in turns])
            assert cached_tokens(answer) >= 2 * KV_BLOCK_SIZE, (tag, answer["usage"])
            assert score_terms(route)["cached"] > 0, route  # the edge predicted the hit
    # Fresh prefixes are spread, not all piled onto one server.
    assert set(placements.values()) == {s.name for s in vllm_pair}, placements
    assert edge_metric(edge, "fedinfer_edge_actual_cached_tokens_total") - actual_before >= (
        4 * 2 * 2 * KV_BLOCK_SIZE
    )
