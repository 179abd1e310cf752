"""P/D disaggregated routing through the edge, as real processes on loopback: the openai SDK
talks to the edge, which runs vLLM's two-hop ``kv_transfer_params`` protocol against
``fedinfer engine-sim`` engines with prefill and decode roles."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.test_edge_support import (
    EdgeProc,
    engine_sims,
    route_of,
    start_edge,
    table_doc,
)

from .test_edge_sim import MODEL, SYSTEM


@dataclass
class PD:
    edge: EdgeProc
    urls: dict[str, str]

    def sdk(self) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=self.edge.url + "/v1", api_key="unused", max_retries=0, timeout=20
        )

    def metric(self, instance: str, name: str) -> float:
        text = httpx.get(self.urls[instance] + "/metrics", timeout=5).text
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name:
                    return float(sample.value)
        raise AssertionError(f"{name} not exported by {instance}")

    def set_table(self, version: int, roles: dict[str, str]) -> None:
        doc = table_doc("pd", version, instances(self.urls, roles))
        tmp = self.edge.table.with_suffix(".tmp")
        tmp.write_text(json.dumps(doc))
        tmp.replace(self.edge.table)


def instances(urls: dict[str, str], roles: dict[str, str]) -> list[dict[str, Any]]:
    return [
        {
            "id": name,
            "url": urls[name],
            "model": MODEL,
            "role": role,
            "max_concurrency": 16,
            "prefill_tokens_per_s": 15000,
        }
        for name, role in roles.items()
    ]


@contextmanager
def pd_cluster(tmp_path: Path, roles: dict[str, str]) -> Iterator[PD]:
    args = ("--num-gpu-blocks", "4096", "--max-model-len", "8192", "--seed", "7")
    with engine_sims(tmp_path, len(roles), MODEL, *args) as engines:
        urls = {f"sim-{e['index']}": e["url"] for e in engines}
        table = table_doc("pd", 1, instances(urls, roles))
        edge = start_edge(tmp_path, table, "--eject-after", "2", "--probe-interval", "0.2")
        try:
            yield PD(edge, urls)
        finally:
            edge.proc.stop()


ROLES = {"sim-0": "prefill", "sim-1": "decode", "sim-2": "decode"}


@pytest.fixture(scope="module")
def pd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PD]:
    with pd_cluster(tmp_path_factory.mktemp("pd"), ROLES) as cluster:
        yield cluster


def messages(question: str) -> Any:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


def test_sdk_chat_goes_prefill_then_decode_without_recomputing(pd: PD) -> None:
    raw = pd.sdk().chat.completions.with_raw_response.create(
        model=MODEL, messages=messages("My last invoice?"), max_tokens=10
    )
    route = route_of(raw.headers)
    answer = raw.parse()
    assert route["mode"] == "pd" and route["prefill"] == "sim-0"
    decoder = route["decode"]
    assert decoder in ("sim-1", "sim-2") and route["kv"] == "transferred"
    assert "prefill;dur=" in raw.headers["server-timing"]
    assert answer.usage is not None and answer.usage.prompt_tokens_details is not None
    prompt = answer.usage.prompt_tokens
    assert answer.usage.prompt_tokens_details.cached_tokens == prompt - 1
    # The decode engine took the prompt's KV from the prefill engine instead of computing it.
    assert pd.metric(decoder, "vllm:external_prefix_cache_hits_total") >= prompt - 1
    assert pd.metric(decoder, "vllm:iteration_tokens_total_sum") < prompt
    assert pd.metric("sim-0", "vllm:prompt_tokens_total") >= prompt
    # Same answer as one engine computing everything (same seed, same prompt).
    alone = httpx.post(
        pd.urls[decoder] + "/v1/chat/completions",
        json={"model": MODEL, "messages": messages("My last invoice?"), "max_tokens": 10},
        timeout=20,
    ).json()
    assert answer.choices[0].message.content == alone["choices"][0]["message"]["content"]


def test_sdk_streaming_passes_the_decode_stream_through(pd: PD) -> None:
    client = pd.sdk()
    question = messages("When is my next payment due?")
    full = client.chat.completions.create(model=MODEL, messages=question, max_tokens=12)
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=question,
        max_tokens=12,
        stream=True,
        stream_options={"include_usage": True},
    )
    route = route_of(raw.headers)
    assert route["mode"] == "pd" and route["prefill"] == "sim-0" and route["kv"] == "transferred"
    chunks = list(raw.parse())
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].usage is not None and chunks[-1].usage.prompt_tokens_details is not None
    usage = chunks[-1].usage
    assert usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens == usage.prompt_tokens - 1


def test_completions_without_stream_options_in_the_prefill_leg(pd: PD) -> None:
    client = pd.sdk()
    raw = client.completions.with_raw_response.create(
        model=MODEL, prompt=SYSTEM + "Summarise.", max_tokens=5, extra_body={"min_tokens": 3}
    )
    route = route_of(raw.headers)
    out = raw.parse()
    assert route["mode"] == "pd" and route["kv"] == "transferred"
    assert out.usage is not None and out.usage.completion_tokens >= 3


def test_a_request_the_prefill_engine_refuses_is_passed_through(pd: PD) -> None:
    resp = httpx.post(
        pd.edge.url + "/v1/chat/completions",
        json={"model": MODEL, "messages": messages("Two answers?"), "max_tokens": 4, "n": 2},
        timeout=20,
    )
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "n"
    route = route_of(resp.headers)
    assert route["prefill"] == "sim-0" and route["decode"] == "none"


def test_a_failing_decode_engine_is_retried_on_the_other(pd: PD) -> None:
    """Last in the module: sim-1 may stay ejected for a while after it."""
    httpx.post(pd.urls["sim-1"] + "/admin/faults", json={"error_rate": 1.0}, timeout=5)
    try:
        for i in range(4):
            raw = pd.sdk().chat.completions.with_raw_response.create(
                model=MODEL, messages=messages(f"Question {i}?"), max_tokens=4
            )
            route = route_of(raw.headers)
            assert route["decode"] == "sim-2" and route["prefill"] == "sim-0"
            assert raw.parse().choices[0].finish_reason == "length"
    finally:
        httpx.post(pd.urls["sim-1"] + "/admin/faults", json={"reset": True}, timeout=5)


def ask(cluster: PD, question: str) -> dict[str, str]:
    raw = cluster.sdk().chat.completions.with_raw_response.create(
        model=MODEL, messages=messages(question), max_tokens=4
    )
    assert raw.parse().choices[0].finish_reason == "length"
    return route_of(raw.headers)


def wait_for(check: Any, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def test_prefill_failures_fall_back_to_mixed_then_to_the_decode_engine(tmp_path: Path) -> None:
    roles = {"sim-0": "prefill", "sim-1": "decode", "sim-2": "mixed"}
    with pd_cluster(tmp_path, roles) as cluster:
        assert ask(cluster, "Balance?")["prefill"] == "sim-0"
        # The prefill engine answers 500: the mixed instance serves the request in one hop.
        httpx.post(cluster.urls["sim-0"] + "/admin/faults", json={"error_rate": 1.0}, timeout=5)
        route = ask(cluster, "Balance again?")
        assert route["instance"] == "sim-2" and "prefill" not in route

        # Without a mixed instance, a failed prefill leg leaves the decode engine to compute
        # the prompt itself, and the route says why.
        cluster.set_table(2, {"sim-0": "prefill", "sim-1": "decode"})
        wait_for(
            lambda: httpx.get(cluster.edge.ops + "/healthz").json()["instances"] == 2,
            "table 2 not applied",
        )
        route = ask(cluster, "And now?")
        assert route["mode"] == "pd" and route["prefill"] == "none"
        assert route["prefill_failed"].startswith("sim-0:status 500")
        assert route["decode"] == "sim-1" and route["kv"] == "none"

        # Killed: once the health checks eject it, requests go straight to the decode engine.
        httpx.post(cluster.urls["sim-0"] + "/admin/faults", json={"kill": True}, timeout=5)
        wait_for(
            lambda: (
                not httpx.get(cluster.edge.ops + "/healthz").json()["detail"]["sim-0"]["healthy"]
            ),
            "sim-0 not ejected",
        )
        route = ask(cluster, "Still there?")
        assert route["mode"] == "decode_only" and route["decode"] == "sim-1"
        assert route["kv"] == "none"


def test_a_pd_stream_cut_mid_way_ends_with_why_it_was_not_continued(tmp_path: Path) -> None:
    """A decode engine that dies mid-stream: the stream is not continued (its KV came from a
    prefill engine; docs/continuation.md) and its error event says so."""
    roles = {"sim-0": "prefill", "sim-1": "decode"}
    with pd_cluster(tmp_path, roles) as cluster:
        body = {
            "model": MODEL,
            "messages": messages("Tell me everything about my account."),
            "max_tokens": 300,
            "ignore_eos": True,
            "stream": True,
        }
        lines: list[str] = []
        with httpx.stream(
            "POST", cluster.edge.url + "/v1/chat/completions", json=body, timeout=30
        ) as r:
            assert route_of(r.headers)["mode"] == "pd"
            for line in r.iter_lines():
                lines.append(line)
                if len(lines) == 10:
                    httpx.post(cluster.urls["sim-1"] + "/admin/faults", json={"kill": True})
    errors = [json.loads(line[6:]) for line in lines if line.startswith('data: {"error"')]
    assert len(errors) == 1 and "data: [DONE]" not in lines
    assert errors[0]["error"]["code"] == "upstream_stream_cut"
    assert "(not continued: prefill_decode)" in errors[0]["error"]["message"]
