"""A stream survives its real vLLM server (``make test-vllm``): the server serving it is SIGKILLed
after some tokens, and the client gets one complete, well-formed stream — the token ids before
the cut the first server's, the rest the second's — with usage equal to what it received and one
usage record (``docs/continuation.md``).

It kills one of the session's servers, so it runs last (``kills_servers``, ``conftest.py``).
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import redis

from regions.supervisor import wait_until
from regions.tables.usage import USAGE_FIELD, USAGE_STREAM, decode_record
from tests.vllm.servers import (
    EDGE_REGION,
    SERVED_MODEL,
    EdgeProcess,
    VllmServer,
    routing_table,
    start_edge,
)

pytestmark = [pytest.mark.vllm, pytest.mark.kills_servers, pytest.mark.timeout(600)]

#: Its own Redis database: the usage stream this test's edge writes.
REDIS_URL = os.environ.get("FEDINFER_VLLM_TEST_REDIS_URL", "redis://127.0.0.1:6379/14")
TOKENS = 160


@pytest.fixture
def usage() -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(REDIS_URL)
    client.delete(USAGE_STREAM)
    yield client
    client.delete(USAGE_STREAM)


@pytest.fixture
def metered_edge(
    vllm_pair: tuple[VllmServer, VllmServer], tmp_path: Path, usage: redis.Redis
) -> Iterator[EdgeProcess]:
    table = tmp_path / "table.json"
    table.write_text(json.dumps(routing_table(vllm_pair)))
    credential = tmp_path / "credential"
    credential.write_text("fedinfer-edge-test-" + "c" * 32)
    credential.chmod(0o600)
    edge = start_edge(
        "edge-continuation",
        table,
        "--region",
        EDGE_REGION,
        "--scrape-timeout",
        "10",
        "--probe-timeout",
        "10",
        "--eject-after",
        "1",
        "--edge-name",
        "edge-vllm",
        "--credential-file",
        str(credential),
        "--usage-spool-dir",
        str(tmp_path / "spool"),
        "--usage-redis-url",
        REDIS_URL,
        healthy_instances=2,
    )
    try:
        yield edge
    finally:
        edge.stop()


def body(**extra: Any) -> dict[str, Any]:
    return {
        "model": SERVED_MODEL,
        "messages": [{"role": "user", "content": "Count the waves on the shore, one by one."}],
        "max_tokens": TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
        **extra,
    }


def events_of(lines: list[str]) -> list[dict[str, Any]]:
    return [orjson.loads(line[6:]) for line in lines if line.startswith("data: {")]


def token_ids(events: list[dict[str, Any]]) -> list[int]:
    return [t for e in events if e.get("choices") for t in e["choices"][0].get("token_ids") or ()]


def test_a_stream_survives_its_vllm_server_sigkilled(
    vllm_pair: tuple[VllmServer, VllmServer], metered_edge: EdgeProcess, usage: redis.Redis
) -> None:
    servers = {s.name: s for s in vllm_pair}
    # What the first server answers alone (greedy: the same on either server).
    with httpx.stream(
        "POST", vllm_pair[0].base_url + "/v1/chat/completions", json=body(), timeout=300
    ) as r:
        reference = events_of(list(r.iter_lines()))
    ref_ids = token_ids(reference)
    prompt = reference[-1]["usage"]["prompt_tokens"]
    assert len(ref_ids) == TOKENS

    finished_before = {s.name: _finished(s) for s in vllm_pair}
    lines: list[str] = []
    with httpx.stream(
        "POST", metered_edge.base_url + "/v1/chat/completions", json=body(), timeout=300
    ) as r:
        assert r.status_code == 200
        route = dict(p.split("=", 1) for p in r.headers["x-fedinfer-route"].split(";") if "=" in p)
        first = servers[route["instance"]]
        second = next(s for s in vllm_pair if s is not first)
        killed_after: int | None = None
        for line in r.iter_lines():
            lines.append(line)
            if killed_after is None and len(token_ids(events_of(lines))) >= 20:
                killed_after = len(token_ids(events_of(lines)))
                # The API server and its engine core: the whole process group, no goodbye.
                os.killpg(first.proc.pid, signal.SIGKILL)
    events = events_of(lines)
    comments = [line for line in lines if line.startswith(":")]
    assert "data: [DONE]" in lines and not any("error" in e for e in events)
    assert comments == [
        f": x-fedinfer-route continued region={EDGE_REGION} instance={second.name} "
        "after=engine_lost leg=2"
    ]
    assert {e["id"] for e in events} == {events[0]["id"]}
    ids = token_ids(events)
    # Before the cut, the first server's ids exactly (all of them relayed as it sent them).
    before = _ids_before_comment(lines)
    assert killed_after is not None and before >= killed_after
    assert ids[:before] == ref_ids[:before]
    # The rest came from the second server: it finished one more request, at the length asked.
    assert len(ids) == TOKENS
    assert _finished(second) == finished_before[second.name] + 1
    finishes = [e["choices"][0]["finish_reason"] for e in events if e.get("choices")]
    assert finishes[-1] == "length" and not any(finishes[:-1])
    usage_doc = events[-1]["usage"]
    assert usage_doc["completion_tokens"] == TOKENS and usage_doc["prompt_tokens"] == prompt

    metered_edge.stop()  # ships what is spooled

    def stored() -> list[Any]:
        entries = usage.xrange(USAGE_STREAM)
        return [decode_record(r) for _, f in entries for r in f[USAGE_FIELD].splitlines()]

    wait_until(lambda: len(stored()) >= 1, what="the usage record", timeout=30)
    time.sleep(0.5)
    (record,) = stored()
    assert (record.prompt_tokens, record.completion_tokens, record.continued) == (
        prompt,
        TOKENS,
        1,
    )
    assert record.legs == f"{EDGE_REGION}/{first.name},{EDGE_REGION}/{second.name}"
    assert record.reprefill_tokens >= prompt + before


def _ids_before_comment(lines: list[str]) -> int:
    """Token ids the client had when the continuation's comment came."""
    at = next(k for k, line in enumerate(lines) if line.startswith(":"))
    return len(token_ids(events_of(lines[:at])))


def _finished(server: VllmServer) -> float:
    """Requests the server finished (``vllm:request_success_total``, every reason)."""
    text = httpx.get(server.base_url + "/metrics", timeout=30).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("vllm:request_success_total{")
    )
