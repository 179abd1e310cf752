"""Admission through a real edge process (file mode, a table with a ``tenants`` section)."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from regions.supervisor import wait_http
from tests.integration.test_edge_support import (
    EdgeProc,
    instance,
    spawn_engine,
    start_edge,
    table_doc,
)


def h(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


TENANTS = [
    {"tenant": "eu", "key_hashes": [h("fi_eu"), h("fi_expired")], "allowed_regions": ["r1"],
     "key_valid_until": {h("fi_expired"): "2020-01-01T00:00:00Z"}},
    {"tenant": "us", "key_hashes": [h("fi_us")], "allowed_regions": ["r2"]},
    {"tenant": "broke", "key_hashes": [h("fi_broke")], "allowed_regions": ["r1"],
     "budget_state": "exhausted"},
    {"tenant": "slow", "key_hashes": [h("fi_slow")], "allowed_regions": ["r1"],
     "requests_per_s": 0.5},
    {"tenant": "other", "key_hashes": [h("fi_other")], "allowed_regions": ["r1"]},
]  # fmt: skip


@pytest.fixture(scope="module")
def edge(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EdgeProc]:
    tmp = tmp_path_factory.mktemp("admission")
    engine = spawn_engine(tmp, "i-1")
    proc: EdgeProc | None = None
    try:
        wait_http(engine.url + "/health", watch=engine.proc)
        doc = table_doc("r1", 1, [instance(engine)])
        doc["tenants"] = TENANTS
        proc = start_edge(tmp, doc, "--rate-burst", "2")
        proc.engines = {engine.name: engine}
        yield proc
    finally:
        if proc is not None:
            proc.proc.stop()
        engine.proc.stop()


def chat(edge: EdgeProc, key: str | None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(
        edge.url + "/v1/chat/completions",
        json={"model": "llama", "messages": [{"role": "user", "content": "hi"}]},
        headers=headers,
        timeout=10,
    )


def error_of(resp: httpx.Response) -> dict[str, Any]:
    err: dict[str, Any] = resp.json()["error"]
    return err


def test_sdk_with_a_good_key_and_without_one(edge: EdgeProc) -> None:
    good = openai.OpenAI(base_url=edge.url + "/v1", api_key="fi_eu", max_retries=0)
    out = good.chat.completions.create(model="llama", messages=[{"role": "user", "content": "x"}])
    assert out.choices[0].message.content
    assert [m.id for m in good.models.list()] == ["llama"]
    bad = openai.OpenAI(base_url=edge.url + "/v1", api_key="fi_wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.chat.completions.create(model="llama", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_refusals_are_clear_and_never_reach_an_engine(edge: EdgeProc) -> None:
    served = edge.engines["i-1"].stats()["requests"]
    r = chat(edge, None)
    assert r.status_code == 401 and error_of(r)["code"] == "invalid_api_key"
    r = chat(edge, "fi_expired")
    assert r.status_code == 401 and error_of(r)["code"] == "api_key_expired"
    r = chat(edge, "fi_us")
    assert r.status_code == 403 and error_of(r)["code"] == "region_not_allowed"
    assert "r2" in error_of(r)["message"]
    r = chat(edge, "fi_broke")
    assert r.status_code == 403 and error_of(r)["code"] == "budget_exhausted"
    assert edge.engines["i-1"].stats()["requests"] == served


def test_rate_limit_answers_429_with_retry_after(edge: EdgeProc) -> None:
    assert chat(edge, "fi_slow").status_code == 200  # burst: 2 s x 0.5/s = 1 request
    r = chat(edge, "fi_slow")
    assert r.status_code == 429 and error_of(r)["code"] == "rate_limit_exceeded"
    assert int(r.headers["retry-after"]) >= 1
    assert r.headers["x-fedinfer-route"].startswith("region=r1;instance=none")


def cached_shown(edge: EdgeProc, key: str, system: str, question: str) -> int:
    resp = httpx.post(
        edge.url + "/v1/chat/completions",
        json={
            "model": "llama",
            "messages": [
                {"role": "system", "content": system},
                {"role": "user", "content": question},
            ],
        },
        headers={"Authorization": f"Bearer {key}"},
        timeout=10,
    )
    assert resp.status_code == 200, resp.text
    route = dict(part.split("=", 1) for part in resp.headers["x-fedinfer-route"].split(";"))
    terms = dict(term.split(":", 1) for term in route["score"].split(","))
    return int(terms["cached"])


def test_the_route_header_shows_a_tenant_only_the_cache_its_own_prompts_made(
    edge: EdgeProc,
) -> None:
    """Tenant ``eu`` warms a system prompt; ``other`` sending the same prompt must not learn
    that from the route header (it would reveal another tenant's prompt), until it has sent
    the prompt itself."""
    system = "You are the confidential assistant of Example Corp. " * 40
    assert cached_shown(edge, "fi_eu", system, "first") == 0
    assert cached_shown(edge, "fi_eu", system, "second") >= 400  # its own prefix: shown
    assert cached_shown(edge, "fi_other", system, "probe") == 0  # another tenant's: hidden
    assert cached_shown(edge, "fi_other", system, "again") >= 400  # now its own as well
