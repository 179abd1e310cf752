"""The edge's OpenTelemetry spans, end to end: a real edge process (``--otlp-endpoint``) in
front of ``fedinfer engine-sim`` engines exports over OTLP/HTTP to a receiver in the test,
which decodes the protobuf. One request's trace runs from admission to the last byte and
carries the route's explanation; a P/D request shows both legs; a queued request its wait."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from regions.supervisor import wait_http, wait_until
from tests.integration.test_edge_pd import instances
from tests.integration.test_edge_sim import MODEL, SYSTEM
from tests.integration.test_edge_support import (
    EdgeProc,
    engine_sims,
    instance,
    route_of,
    spawn_engine,
    start_edge,
    table_doc,
)
from tests.integration.test_tracing_support import (
    CLIENT,
    FAST_EXPORT,
    SERVER,
    Receiver,
    SpanRecord,
    otlp_receiver,
)

KEY = "fi_tracing_secret_key"
TENANTS = [
    {
        "tenant": "acme",
        "key_hashes": [hashlib.sha256(KEY.encode()).hexdigest()],
        "allowed_regions": ["sim", "pd", "r1"],
    }
]
CALLER_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN = "00f067aa0ba902b7"


@pytest.fixture(scope="module")
def receiver() -> Iterator[Receiver]:
    with pytest.MonkeyPatch.context() as mp, otlp_receiver() as rx:
        for name, value in FAST_EXPORT.items():
            mp.setenv(name, value)
        yield rx


def traced_edge(tmp: Path, rx: Receiver, doc: dict[str, object], *args: str) -> EdgeProc:
    doc["tenants"] = TENANTS
    return start_edge(tmp, doc, "--otlp-endpoint", rx.url, *args)


def ask(edge: EdgeProc, question: str, stream: bool, trace: str = CALLER_TRACE) -> httpx.Response:
    body = {
        "model": MODEL,
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        "max_tokens": 8,
        "stream": stream,
    }
    headers = {"authorization": f"Bearer {KEY}", "traceparent": f"00-{trace}-{CALLER_SPAN}-01"}
    resp = httpx.post(edge.url + "/v1/chat/completions", json=body, headers=headers, timeout=30)
    assert resp.status_code == 200, resp.text
    return resp


def by_name(spans: list[SpanRecord]) -> dict[str, list[SpanRecord]]:
    out: dict[str, list[SpanRecord]] = {}
    for s in spans:
        out.setdefault(s.name, []).append(s)
    return out


def assert_no_secrets(spans: list[SpanRecord], *secrets: str) -> None:
    for s in spans:
        for value in s.attributes.values():
            for secret in secrets:
                assert secret not in str(value), (s.name, value)


def test_one_request_from_admission_to_last_byte_with_the_route(
    tmp_path: Path, receiver: Receiver
) -> None:
    # One engine: the warm-up's prompt is on the engine the second request is sure to get.
    with engine_sims(tmp_path, 1, MODEL, "--seed", "3") as engines:
        doc = table_doc("sim", 1, [
            {"id": f"sim-{e['index']}", "url": e["url"], "model": MODEL, "max_concurrency": 8,
             "prefill_tokens_per_s": 15000} for e in engines
        ])  # fmt: skip
        edge = traced_edge(tmp_path, receiver, doc)
        try:
            ask(edge, "Warm the cache?", stream=False, trace="1" * 32)
            resp = ask(edge, "Which invoice is overdue?", stream=True)
            body = resp.text
            refused = httpx.post(
                edge.url + "/v1/chat/completions",
                json={"model": MODEL, "messages": [{"role": "user", "content": "x"}]},
                headers={"authorization": "Bearer fi_wrong", "traceparent": f"00-{'8' * 32}-"
                         f"{CALLER_SPAN}-01"},
                timeout=30,
            )  # fmt: skip
            assert refused.status_code == 401
        finally:
            edge.proc.stop()
    assert body.rstrip().endswith("data: [DONE]")
    route = route_of(resp.headers)
    # The answer's traceparent continues the caller's trace, naming the edge's span.
    _, trace_id, edge_span, _ = resp.headers["traceparent"].split("-")
    assert trace_id == CALLER_TRACE
    spans = receiver.trace(CALLER_TRACE, "edge.request")
    named = by_name(spans)
    (root,) = named["edge.request"]
    assert root.service == "fedinfer-edge" and root.kind == SERVER
    assert root.parent_id == CALLER_SPAN and root.span_id == edge_span
    # The route's explanation, as the header gave it to the client.
    a = root.attributes
    assert a["http.response.status_code"] == 200
    assert a["fedinfer.route.region"] == "sim" == route["region"]
    assert a["fedinfer.route.instance"] == route["instance"] == a["fedinfer.instance"]
    assert a["fedinfer.route.policy_reason"] == route["policy_reason"]
    assert a["fedinfer.cached_tokens_predicted"] > 0  # the warm-up put the system prompt there
    assert a["fedinfer.tenant"] == "acme" and a["gen_ai.request.model"] == MODEL
    assert a["fedinfer.stream"] is True and a["gen_ai.usage.output_tokens"] == 8
    assert a["fedinfer.ttft_ms"] > 0
    # Every stage under the request's span, in order, inside it.
    (admit,) = named["edge.admit"]
    (schedule,) = named["edge.schedule"]
    (upstream,) = named["edge.upstream"]
    for child in (admit, schedule, upstream):
        assert child.parent_id == root.span_id
        assert root.start_ns <= child.start_ns <= child.end_ns <= root.end_ns
    assert admit.end_ns <= schedule.start_ns <= schedule.end_ns <= upstream.start_ns
    assert schedule.attributes["fedinfer.instance"] == route["instance"]
    assert schedule.attributes["fedinfer.cached_tokens_predicted"] == int(
        a["fedinfer.cached_tokens_predicted"]
    )
    assert upstream.kind == CLIENT and upstream.attributes["fedinfer.target"] == route["instance"]
    # The last byte: the request's span ends no earlier than the upstream relay did.
    assert upstream.end_ns <= root.end_ns
    assert_no_secrets(spans, KEY, "Which invoice", "billing assistant")
    # A refusal at admission is a trace too: the request's span alone, with its status.
    (refusal,) = receiver.trace("8" * 32, "edge.request")
    assert refusal.attributes["http.response.status_code"] == 401
    assert refusal.attributes["fedinfer.route.reason"] == "invalid_api_key"
    assert refusal.status == 0 and refusal.parent_id == CALLER_SPAN


def test_a_pd_request_shows_both_legs(tmp_path: Path, receiver: Receiver) -> None:
    roles = {"sim-0": "prefill", "sim-1": "decode"}
    args = ("--num-gpu-blocks", "4096", "--max-model-len", "8192", "--seed", "7")
    with engine_sims(tmp_path, len(roles), MODEL, *args) as engines:
        urls = {f"sim-{e['index']}": e["url"] for e in engines}
        edge = traced_edge(tmp_path, receiver, table_doc("pd", 1, instances(urls, roles)))
        trace = "2" * 32
        try:
            resp = ask(edge, "My last invoice?", stream=True, trace=trace)
        finally:
            edge.proc.stop()
    route = route_of(resp.headers)
    assert route["mode"] == "pd" and route["kv"] == "transferred"
    spans = receiver.trace(trace, "edge.request")
    named = by_name(spans)
    (root,) = named["edge.request"]
    (prefill,) = named["edge.pd.prefill"]
    (decode,) = named["edge.pd.decode"]
    assert prefill.parent_id == decode.parent_id == root.span_id
    assert prefill.attributes["fedinfer.target"] == "sim-0" == route["prefill"]
    assert prefill.attributes["fedinfer.kv_transferred"] is True
    assert decode.attributes["fedinfer.target"] == "sim-1" == route["decode"]
    assert prefill.end_ns <= decode.start_ns <= decode.end_ns <= root.end_ns
    assert root.attributes["fedinfer.route.mode"] == "pd"
    assert root.attributes["fedinfer.route.prefill"] == "sim-0"
    assert root.attributes["fedinfer.route.decode"] == "sim-1"
    assert root.attributes["fedinfer.tenant"] == "acme"
    # The prefill instance was scheduled (its own line): one decision for that role.
    assert [s.attributes["fedinfer.role"] for s in named["edge.schedule"]] == ["prefill"]


def test_a_continued_stream_shows_each_leg(tmp_path: Path, receiver: Receiver) -> None:
    """The engine serving a stream dies after its first tokens: the trace has the first leg
    (``edge.upstream``) and the continuation (``edge.continue``) on the other engine."""
    with engine_sims(tmp_path, 2, MODEL, "--seed", "3") as engines:
        urls = {f"sim-{e['index']}": e["url"] for e in engines}
        doc = table_doc("sim", 1, [
            {"id": name, "url": url, "model": MODEL, "max_concurrency": 8,
             "prefill_tokens_per_s": 15000} for name, url in urls.items()
        ])  # fmt: skip
        edge = traced_edge(tmp_path, receiver, doc)
        trace = "c" * 32
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "A long tale, please."}],
            "max_tokens": 120,
            "ignore_eos": True,
            "stream": True,
        }
        headers = {"authorization": f"Bearer {KEY}", "traceparent": f"00-{trace}-{CALLER_SPAN}-01"}
        try:
            with httpx.stream(
                "POST", edge.url + "/v1/chat/completions", json=body, headers=headers, timeout=30
            ) as r:
                first = route_of(r.headers)["instance"]
                lines = r.iter_lines()
                got = [next(lines) for _ in range(4)]
                httpx.post(urls[first] + "/admin/faults", json={"kill": True}, timeout=5)
                got += list(lines)
        finally:
            edge.proc.stop()
    assert "data: [DONE]" in got
    named = by_name(receiver.trace(trace, "edge.request"))
    (root,) = named["edge.request"]
    (upstream,) = named["edge.upstream"]
    (continued,) = named["edge.continue"]
    (other,) = set(urls) - {first}
    assert upstream.attributes["fedinfer.target"] == first
    assert continued.attributes["fedinfer.target"] == other
    assert continued.parent_id == root.span_id and continued.kind == CLIENT
    assert upstream.end_ns <= continued.start_ns <= continued.end_ns <= root.end_ns


def test_a_queued_request_has_a_queue_span_and_engines_get_the_leg_span(
    tmp_path: Path, receiver: Receiver
) -> None:
    """One slot, two requests at once: the second waits at the gateway. The engine's
    ``traceparent`` names the edge's upstream span (so an engine's spans hang under it)."""
    engine = spawn_engine(tmp_path, "i-1", "--model", MODEL, "--token-delay", "0.1")
    try:
        wait_http(engine.url + "/health", watch=engine.proc)
        doc = table_doc("r1", 1, [instance(engine, model=MODEL, max_concurrency=1)])
        edge = traced_edge(tmp_path, receiver, doc, "--queue-timeout", "20")
        try:
            traces = ["3" * 32, "4" * 32]
            first = threading.Thread(target=ask, args=(edge, "q0", False, traces[0]))
            first.start()
            # The second arrives while the first holds the only slot (the engine runs it).
            wait_until(lambda: engine.stats()["running"] == 1, what="the first request running")
            ask(edge, "q1", False, traces[1])
            first.join(timeout=60)
            seen = engine.stats()["traceparents"]
        finally:
            edge.proc.stop()
    finally:
        engine.proc.stop()
    all_spans = [s for t in traces for s in receiver.trace(t, "edge.request")]
    second = by_name(receiver.trace(traces[1], "edge.request"))
    (queued,) = second["edge.queue"]
    (schedule,) = second["edge.schedule"]
    assert queued.parent_id == schedule.span_id
    assert schedule.attributes["fedinfer.queue_ms"] >= 100  # the first held the slot that long
    (first_upstream,) = by_name(receiver.trace(traces[0], "edge.request"))["edge.upstream"]
    assert queued.end_ns >= first_upstream.end_ns - 5_000_000  # it got the slot when freed
    upstream_ids = {s.span_id for s in all_spans if s.name == "edge.upstream"}
    assert {tp.split("-")[2] for tp in seen} == upstream_ids


def test_tracing_asked_for_without_the_extra_stops_the_edge_with_a_clear_message(
    tmp_path: Path,
) -> None:
    """As if ``fedinfer[tracing]`` were not installed: opentelemetry cannot be imported."""
    table = tmp_path / "table.json"
    table.write_text(json.dumps(table_doc("r1", 1, [])))
    code = (
        "import sys; sys.modules['opentelemetry'] = None\n"
        "from regions.edge.cli import main\n"
        f"main(['--region', 'r1', '--table', {str(table)!r}, "
        "'--otlp-endpoint', 'http://127.0.0.1:9/v1/traces'])\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert out.returncode == 1
    assert "--otlp-endpoint needs the tracing extra" in out.stderr
    assert "pip install 'fedinfer[tracing]'" in out.stderr


def test_tracing_off_loads_neither_the_tracing_module_nor_the_sdk(tmp_path: Path) -> None:
    """The default edge has no tracer, its admit stage is the plain one (no span per request),
    and neither ``regions.edge.tracing`` nor the SDK's tracing or exporters is loaded. (redis-py
    imports OpenTelemetry's API and metrics SDK when installed, for its own metrics.)"""
    code = (
        "import sys\n"
        "from regions.edge.cli import build_parser, config_from_args, make_edge\n"
        f"edge = make_edge(config_from_args(build_parser().parse_args(['--region', 'r1', "
        f"'--table', {str(tmp_path / 'table.json')!r}])))\n"
        "assert edge.tracer is None and edge.admit_stage is edge.admit\n"
        "print(sorted(m for m in sys.modules if m.startswith(('regions.edge.tracing', "
        "'opentelemetry.sdk.trace', 'opentelemetry.exporter'))))\n"
    )
    (tmp_path / "table.json").write_text(json.dumps(table_doc("r1", 1, [])))
    env = {k: v for k, v in os.environ.items() if k != "FEDINFER_OTLP_ENDPOINT"}
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
