"""The edge as a process in front of engines on loopback, driven by the official ``openai`` SDK."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.integration.test_edge_support import (
    EdgeProc,
    cluster,
    instance,
    route_of,
    table_doc,
)

SYSTEM = "You are a careful assistant who answers briefly. " * 40  # ~2000 bytes: ~30 blocks


@pytest.fixture(scope="module")
def edge(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EdgeProc]:
    tmp = tmp_path_factory.mktemp("edge")
    with cluster(tmp, 3, edge_args=("--max-body-bytes", "200000")) as e:
        yield e


def client(edge: EdgeProc) -> openai.OpenAI:
    return openai.OpenAI(base_url=edge.url + "/v1", api_key="unused", max_retries=0, timeout=10)


def test_sdk_chat_non_streaming_with_route_and_timing_headers(edge: EdgeProc) -> None:
    raw = client(edge).chat.completions.with_raw_response.create(
        model="llama", messages=[{"role": "user", "content": "hello"}]
    )
    completion = raw.parse()
    route = route_of(raw.headers)
    assert route["region"] == "r1"
    assert route["instance"] in edge.engines
    assert completion.choices[0].message.content.startswith(route["instance"] + ":")
    assert "ttft_ms:" in route["score"] and "runner_up" in route
    assert route["retries"] == "0"
    timing = raw.headers["server-timing"]
    assert "queue;dur=" in timing and "connect;dur=" in timing and "ttft;dur=" in timing
    assert completion.usage is not None and completion.usage.prompt_tokens > 0


def test_sdk_chat_streaming_passes_chunks_and_hides_the_usage_chunk_it_added(
    edge: EdgeProc,
) -> None:
    stream = client(edge).chat.completions.create(
        model="llama", messages=[{"role": "user", "content": "stream please"}], stream=True
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text.split(":")[0] in edge.engines and text.endswith(" t4")
    assert all(c.usage is None for c in chunks), "the edge added include_usage; client did not"


def test_sdk_streaming_with_usage_requested_gets_cached_tokens(edge: EdgeProc) -> None:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "q1"}]
    c = client(edge)
    for _ in range(2):
        chunks = list(
            c.chat.completions.create(
                model="llama",
                messages=messages,  # type: ignore[arg-type]
                stream=True,
                stream_options={"include_usage": True},
            )
        )
    usage = chunks[-1].usage
    assert usage is not None and usage.prompt_tokens_details is not None
    assert (usage.prompt_tokens_details.cached_tokens or 0) >= 400


def test_sdk_completions_streaming_and_not(edge: EdgeProc) -> None:
    c = client(edge)
    done = c.completions.create(model="llama", prompt="once upon a time")
    assert done.choices[0].text.split(":")[0] in edge.engines
    parts = list(c.completions.create(model="llama", prompt="once upon a time", stream=True))
    assert "".join(p.choices[0].text for p in parts if p.choices).endswith(" t4")


def test_repeated_prefix_lands_where_it_is_cached(edge: EdgeProc) -> None:
    c = client(edge)
    system = "Shared corporate policy prompt, version 7. " * 60
    seen = set()
    cached_reported = []
    for k in range(6):
        raw = c.chat.completions.with_raw_response.create(
            model="llama",
            messages=[{"role": "system", "content": system}, {"role": "user", "content": f"#{k}"}],
        )
        seen.add(route_of(raw.headers)["instance"])
        usage = raw.parse().usage
        assert usage is not None and usage.prompt_tokens_details is not None
        cached_reported.append(usage.prompt_tokens_details.cached_tokens)
    assert len(seen) == 1, f"one shared prefix should stay on one instance, went to {seen}"
    assert all(c >= 500 for c in cached_reported[1:])


def test_session_affinity_by_header_and_user_field(edge: EdgeProc) -> None:
    c = client(edge)
    for sid in ("s-a", "s-b", "s-c"):
        places = {
            route_of(
                c.chat.completions.with_raw_response.create(
                    model="llama",
                    messages=[{"role": "user", "content": f"turn {t} of {sid}"}],
                    extra_headers={"x-session-id": sid},
                ).headers
            )["instance"]
            for t in range(4)
        }
        assert len(places) == 1
    users = {
        route_of(
            c.chat.completions.with_raw_response.create(
                model="llama", messages=[{"role": "user", "content": f"u{t}"}], user="alice"
            ).headers
        )["instance"]
        for t in range(4)
    }
    assert len(users) == 1


def test_session_ids_are_bounded(edge: EdgeProc) -> None:
    """A session id is hashed to a fixed-size key; longer than 256 bytes it is refused, so a
    client cannot make the edge keep (or hash and forward) megabytes per request."""
    body = {"model": "llama", "messages": [{"role": "user", "content": "x"}]}
    ok = httpx.post(
        edge.url + "/v1/chat/completions", json=body, headers={"x-session-id": "s" * 256}
    )
    assert ok.status_code == 200, ok.text
    for extra, headers in (({}, {"x-session-id": "s" * 257}), ({"user": "u" * 257}, {})):
        r = httpx.post(edge.url + "/v1/chat/completions", json=body | extra, headers=headers)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["code"] == "invalid_session_id"


def test_traceparent_is_propagated_with_the_callers_trace_id(edge: EdgeProc) -> None:
    trace = "4bf92f3577b34da6a3ce929d0e0e4736"
    caller = f"00-{trace}-00f067aa0ba902b7-01"
    r = httpx.post(
        edge.url + "/v1/chat/completions",
        json={"model": "llama", "messages": [{"role": "user", "content": "trace me"}]},
        headers={"traceparent": caller},
    )
    assert r.status_code == 200
    upstream = r.json()["system_fingerprint"]
    assert upstream.startswith(f"00-{trace}-") and upstream != caller
    assert r.headers["traceparent"] == upstream
    fresh = httpx.post(
        edge.url + "/v1/chat/completions",
        json={"model": "llama", "messages": [{"role": "user", "content": "no trace"}]},
    )
    assert len(fresh.json()["system_fingerprint"].split("-")[1]) == 32


@pytest.mark.parametrize(
    ("body", "headers", "status", "code"),
    [
        (b"{not json", {"content-type": "application/json"}, 400, "invalid_json"),
        (b'{"messages":[{"role":"user","content":"x"}]}', {}, 400, "missing_model"),
        (b'{"model":"llama"}', {}, 400, "missing_messages"),
        (
            b'{"model":"gpt-9","messages":[{"role":"user","content":"x"}]}',
            {},
            404,
            "model_not_found",
        ),
        (b'{"model":"llama"}', {"content-type": "text/plain"}, 415, "unsupported_media_type"),
        (b'{"model":"llama","pad":"' + b"x" * 300_000 + b'"}', {}, 413, "body_too_large"),
    ],
)
def test_bad_input_gets_openai_style_errors(
    edge: EdgeProc, body: bytes, headers: dict[str, str], status: int, code: str
) -> None:
    sent = {"content-type": "application/json", **headers}
    r = httpx.post(edge.url + "/v1/chat/completions", content=body, headers=sent)
    assert r.status_code == status
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == code
    assert "x-fedinfer-route" in r.headers


def test_sdk_maps_unknown_model_to_not_found(edge: EdgeProc) -> None:
    with pytest.raises(openai.NotFoundError):
        client(edge).chat.completions.create(
            model="gpt-9", messages=[{"role": "user", "content": "x"}]
        )


def test_operator_endpoints_are_not_on_the_public_port(edge: EdgeProc) -> None:
    """Instance names, loads and per-model series are for operators: the public port answers
    404 for them, the operator listener serves them (and no inference route)."""
    for path in ("/healthz", "/metrics"):
        public = httpx.get(edge.url + path)
        assert public.status_code == 404, (path, public.text)
        assert "sim" not in public.text and "i-1" not in public.text
        assert httpx.get(edge.ops + path).status_code == 200
    assert httpx.post(edge.ops + "/v1/chat/completions", json={}).status_code == 405
    assert httpx.get(edge.ops + "/v1/models").status_code == 404


def test_models_healthz_and_metrics(edge: EdgeProc) -> None:
    models = client(edge).models.list()
    assert [m.id for m in models.data] == ["llama"]
    health = httpx.get(edge.ops + "/healthz").json()
    assert health["healthy_instances"] == 3 and health["table_version"] == 1
    time.sleep(0.3)
    text = httpx.get(edge.ops + "/metrics").text
    for name in (
        'fedinfer_edge_requests_total{instance="',
        "fedinfer_edge_ttft_seconds_bucket",
        "fedinfer_edge_request_duration_seconds_bucket",
        "fedinfer_edge_predicted_cached_tokens_total",
        "fedinfer_edge_actual_cached_tokens_total",
        "fedinfer_edge_queue_depth",
        "fedinfer_edge_table_version 1.0",
    ):
        assert name in text, name


def test_table_reload_on_sighup_and_bad_table_is_refused(edge: EdgeProc) -> None:
    engines = list(edge.engines.values())
    good = table_doc(
        "r1",
        2,
        [instance(e) for e in engines] + [instance(engines[0], id="i-lora", adapters=["sql"])],
    )
    write_atomically(edge.table, json.dumps(good))
    edge.proc.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 5
    while httpx.get(edge.ops + "/healthz").json()["table_version"] != 2:
        assert time.monotonic() < deadline, "table version 2 not applied"
        time.sleep(0.05)
    assert [m.id for m in client(edge).models.list().data] == ["llama", "sql"]
    # Going backwards, or broken: refused, version 2 stays.
    for bad in (json.dumps(table_doc("r1", 1, [instance(engines[0])])), "{broken"):
        before = rejections(edge)
        write_atomically(edge.table, bad)
        edge.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 5
        while rejections(edge) == before:
            assert time.monotonic() < deadline, f"table {bad[:20]!r} was not refused"
            time.sleep(0.05)
    assert httpx.get(edge.ops + "/healthz").json()["table_version"] == 2
    answer = client(edge).chat.completions.create(
        model="sql", messages=[{"role": "user", "content": "still served"}]
    )
    assert answer.choices[0].message.content == "i-1: t1 t2 t3 t4"


def write_atomically(path: Path, text: str) -> None:
    """How a table should be published: a reader never sees a half-written file."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def rejections(edge: EdgeProc) -> float:
    for line in httpx.get(edge.ops + "/metrics").text.splitlines():
        if line.startswith("fedinfer_edge_table_rejections_total "):
            return float(line.split()[1])
    raise AssertionError("rejection counter missing")
