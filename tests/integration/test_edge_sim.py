"""The edge in front of ``fedinfer engine-sim`` (vLLM-faithful engines), as real processes.

One simulator process hosts three engines; faults are set through its admin endpoint: an
engine killed mid-stream, an engine answering 500, an engine failing its health checks.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from regions.supervisor import wait_until
from tests.integration.test_edge_support import (
    EdgeProc,
    engine_sims,
    route_of,
    start_edge,
    table_doc,
)

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
SYSTEM = "You are the billing assistant of a large company; answer in one line. " * 40


@dataclass
class SimEdge:
    edge: EdgeProc
    urls: dict[str, str]

    def sdk(self) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=self.edge.url + "/v1", api_key="unused", max_retries=0, timeout=20
        )

    def fault(self, instance: str, **faults: Any) -> None:
        r = httpx.post(self.urls[instance] + "/admin/faults", json=faults, timeout=5)
        r.raise_for_status()

    def health(self) -> dict[str, Any]:
        return dict(httpx.get(self.edge.ops + "/healthz", timeout=5).json())


@contextmanager
def sim_cluster(tmp_path: Path) -> Iterator[SimEdge]:
    """Three simulated engines in one ``engine-sim`` process, behind one edge."""
    args = ("--num-gpu-blocks", "4096", "--max-model-len", "8192", "--seed", "5")
    with engine_sims(tmp_path, 3, MODEL, *args) as engines:
        urls = {f"sim-{e['index']}": e["url"] for e in engines}
        instances = [
            {
                "id": name,
                "url": url,
                "model": MODEL,
                "accelerator": "H100-80G",
                "max_concurrency": 32,
                "prefill_tokens_per_s": 15000,
            }
            for name, url in urls.items()
        ]
        edge = start_edge(
            tmp_path,
            table_doc("sim", 1, instances),
            "--eject-after",
            "2",
            "--probe-interval",
            "0.2",
            "--backoff-base",
            "0.5",
        )
        try:
            yield SimEdge(edge, urls)
        finally:
            edge.proc.stop()


@pytest.fixture(scope="module")
def sim_edge(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimEdge]:
    """Shared by the tests that leave every engine alive (faults are reset after each)."""
    with sim_cluster(tmp_path_factory.mktemp("sim")) as se:
        yield se


@pytest.fixture
def own_sim_edge(tmp_path: Path) -> Iterator[SimEdge]:
    with sim_cluster(tmp_path) as se:
        yield se


def ask(se: SimEdge, content: str, **kw: Any) -> httpx.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 4}
    body.update(kw)
    return httpx.post(se.edge.url + "/v1/chat/completions", json=body, timeout=20)


def test_sdk_through_the_edge_to_simulated_engines(sim_edge: SimEdge) -> None:
    client = sim_edge.sdk()
    assert [m.id for m in client.models.list()] == [MODEL]
    messages: Any = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hi"}]
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=messages, max_tokens=8
    )
    full = raw.parse()
    first = route_of(raw.headers)["instance"]
    assert full.choices[0].message.content and full.usage is not None

    stream = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=8, stream=True
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert all(c.usage is None for c in chunks)

    # The shared prefix went back to where it is cached, and the engine confirms the hit.
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=messages, max_tokens=8
    )
    assert route_of(raw.headers)["instance"] == first
    usage = raw.parse().usage
    assert usage is not None and usage.prompt_tokens_details is not None
    assert (usage.prompt_tokens_details.cached_tokens or 0) >= 512
    assert "cached:" in route_of(raw.headers)["score"]

    completion = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=4)
    assert completion.choices[0].text

    # The edge reads the simulator's real /metrics.
    wait_until(
        lambda: all(d["scraped_age_s"] is not None for d in sim_edge.health()["detail"].values()),
        what="every engine's /metrics read",
    )
    detail = sim_edge.health()["detail"]
    assert all(d["scraped_age_s"] is not None and d["scraped_age_s"] < 2 for d in detail.values())
    metrics = httpx.get(sim_edge.edge.ops + "/metrics").text
    assert f'fedinfer_edge_actual_cached_tokens_total{{instance="{first}"' in metrics


def test_engine_killed_mid_stream_on_the_simulator(own_sim_edge: SimEdge) -> None:
    """The stream goes on on another engine; requests sent meanwhile are retried; the dead
    engine is ejected."""
    sim_edge = own_sim_edge
    client = sim_edge.sdk()
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Tell me a long story."}],
        max_tokens=400,
        stream=True,
        stream_options={"include_usage": True},
    )
    victim = route_of(raw.headers)["instance"]
    stream = raw.parse()
    chunks = [next(iter(stream))]
    with ThreadPoolExecutor(6) as pool:
        during = [pool.submit(ask, sim_edge, f"independent {k}") for k in range(6)]
        sim_edge.fault(victim, kill=True)
        statuses = [f.result().status_code for f in during]
    assert statuses == [200] * 6
    chunks += list(stream)
    assert {c.id for c in chunks} == {chunks[0].id}
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] in ("stop", "length") and not any(finishes[:-1])
    usage = chunks[-1].usage
    assert usage is not None
    # A token an event (the stop token's text is empty), after the opening role event.
    assert usage.completion_tokens == sum(1 for c in chunks if c.choices) - 1
    metrics = httpx.get(sim_edge.edge.ops + "/metrics").text
    assert 'outcome="continued",reason="engine_lost"} 1.0' in metrics
    time.sleep(0.5)
    after = [ask(sim_edge, f"after {k}") for k in range(8)]
    assert all(r.status_code == 200 for r in after)
    assert victim not in {route_of(r.headers)["instance"] for r in after}
    assert sim_edge.health()["detail"][victim]["healthy"] is False


def test_5xx_answers_are_retried_elsewhere_and_eject(sim_edge: SimEdge) -> None:
    sick = "sim-1"
    sim_edge.fault(sick, error_rate=1.0)
    routes = []
    try:
        for k in range(10):
            r = ask(sim_edge, f"q{k}")
            assert r.status_code == 200, r.text
            routes.append(route_of(r.headers))
    finally:
        sim_edge.fault(sick, reset=True)
    assert all(r["instance"] != sick for r in routes)
    retried = sum(r["retries"] == "1" for r in routes)
    metrics = httpx.get(sim_edge.edge.ops + "/metrics").text
    ejections = metric_value(metrics, f'fedinfer_edge_ejections_total{{instance="{sick}"}}')
    # Two 5xx eject it; after each backoff it is readmitted on probation and one 5xx ejects it
    # again (for twice as long): every retry is accounted for by that rule.
    assert ejections >= 1
    assert retried == 2 + (ejections - 1), (retried, ejections)
    assert metric_value(metrics, f'fedinfer_edge_retries_total{{model="{MODEL}"}}') == retried


def metric_value(text: str, series: str) -> int:
    for line in text.splitlines():
        if line.startswith(series + " "):
            return int(float(line.split()[-1]))
    raise AssertionError(
        f"{series} not in /metrics: {[x for x in text.splitlines() if 'eject' in x]}"
    )


def test_health_probe_hysteresis_ejects_and_readmits(
    sim_edge: SimEdge, request: pytest.FixtureRequest
) -> None:
    flaky = "sim-2"
    sim_edge.fault(flaky, health_fail=True)
    request.addfinalizer(lambda: sim_edge.fault(flaky, reset=True))
    deadline = time.monotonic() + 5
    while sim_edge.health()["detail"][flaky]["healthy"]:
        assert time.monotonic() < deadline, "not ejected by failing probes"
        time.sleep(0.05)
    assert "probe status 503" in sim_edge.health()["detail"][flaky]["reason"]
    assert all(route_of(ask(sim_edge, f"x{k}").headers)["instance"] != flaky for k in range(6))
    sim_edge.fault(flaky, reset=True)
    deadline = time.monotonic() + 5
    while not sim_edge.health()["detail"][flaky]["healthy"]:
        assert time.monotonic() < deadline, "not readmitted after probes recovered"
        time.sleep(0.05)
    seen = {route_of(ask(sim_edge, f"y{k}").headers)["instance"] for k in range(9)}
    assert flaky in seen


def test_an_isolated_tenants_cache_is_its_own(tmp_path: Path) -> None:
    """A tenant whose policy carries a ``cache_salt`` gets it sent as vLLM's ``cache_salt``: a
    prompt it warmed is a hit for itself and a miss for anyone else (no timing or usage signal
    of its prompts), while unsalted tenants still share caches. One engine, so every request
    meets the same cache."""

    def key_hash(key: str) -> str:
        return hashlib.sha256(key.encode()).hexdigest()

    with engine_sims(tmp_path, 1, MODEL, "--num-gpu-blocks", "4096", "--seed", "5") as engines:
        doc = table_doc("sim", 1, [{"id": "sim-0", "url": engines[0]["url"], "model": MODEL}])
        doc["tenants"] = [
            {"tenant": "vault", "key_hashes": [key_hash("fi_vault")], "allowed_regions": ["sim"],
             "cache_salt": "c2VjcmV0LXNhbHQtb2YtdGhlLXZhdWx0LXRlbmFudC0wMDAx"},
            {"tenant": "open", "key_hashes": [key_hash("fi_open")], "allowed_regions": ["sim"]},
            {"tenant": "peer", "key_hashes": [key_hash("fi_peer")], "allowed_regions": ["sim"]},
        ]  # fmt: skip
        edge = start_edge(tmp_path, doc)
        try:

            def cached(key: str, system: str, question: str, **extra: Any) -> int:
                resp = httpx.post(
                    edge.url + "/v1/chat/completions",
                    json={
                        "model": MODEL,
                        "messages": [
                            {"role": "system", "content": system},
                            {"role": "user", "content": question},
                        ],
                        "max_tokens": 2,
                        **extra,
                    },
                    headers={"Authorization": f"Bearer {key}"},
                    timeout=20,
                )
                assert resp.status_code == 200, resp.text
                return int(resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"])

            secret = "The vault tenant's confidential operating instructions. " * 30
            assert cached("fi_vault", secret, "one") == 0
            assert cached("fi_vault", secret, "two") >= 256  # its own: a hit
            assert cached("fi_open", secret, "probe") == 0  # another tenant: a miss
            # A client cannot pick the vault's salt: its own salt is used as given, and the
            # vault's requests carry the vault's salt joined with theirs.
            salt = "c2VjcmV0LXNhbHQtb2YtdGhlLXZhdWx0LXRlbmFudC0wMDAx"
            assert cached("fi_open", secret, "forge", cache_salt=salt) == 0
            # Unsalted tenants still share the engine's cache.
            shared = "A system prompt many tenants use, word for word. " * 30
            assert cached("fi_open", shared, "one") == 0
            assert cached("fi_peer", shared, "two") >= 256
        finally:
            edge.proc.stop()
