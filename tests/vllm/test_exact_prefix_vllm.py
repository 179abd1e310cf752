"""Exact prefix-cache knowledge against a real vLLM 0.32 (``make test-vllm``).

One vLLM CPU server runs with ``--prefix-caching-hash-algo sha256_cbor`` and publishes KV
events; the edge has the model's tokenizer (``--tokenizer tiny-llama=var/tiny-llama``), renders
the chat template, computes vLLM's block hashes and looks them up in what the events say the
engine holds. For prompts sharing block-aligned prefixes, the edge's predicted cached tokens
(the route header's ``cached``) equal vLLM's ``usage.prompt_tokens_details.cached_tokens``, for
chat (system prompt shared, user turn different), completions (prompt string) and token-id
prompts, with and without a ``cache_salt``.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from regions.edge.view.token_prefix import RECENT_S
from regions.supervisor import free_port
from tests.vllm.capture_fixtures import shared_prefix
from tests.vllm.servers import (
    KV_BLOCK_SIZE,
    SERVED_MODEL,
    EdgeProcess,
    start_edge,
    start_server,
    wait_healthy,
)

# Starting vLLM takes 3-4 minutes on a loaded 2-core machine: more than the default timeout.
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def exact_edge(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EdgeProcess]:
    """A vLLM server with KV events and sha256_cbor hashes, and an edge with its tokenizer."""
    events_port = free_port()
    config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        # loopback only; "::" makes vLLM bind (not connect), libzmq binds it as 127.0.0.1
        "endpoint": f"tcp://[::ffff:127.0.0.1]:{events_port}",
        "topic": "kv-events",
    }
    extra_args = ("--kv-events-config", json.dumps(config))  # sha256_cbor: servers.py
    cpu = sorted(os.sched_getaffinity(0))[-1]
    server = start_server("vllm-exact", tiny_model, cpu, extra_args)
    edge: EdgeProcess | None = None
    try:
        wait_healthy([server])
        table = {
            "schema_version": 1,
            "version": 1,
            "region": "cpu-lab",
            "generated_at": "2026-12-01T12:00:00Z",
            "instances": [
                {
                    "id": "vllm-exact",
                    "url": server.base_url,
                    "model": SERVED_MODEL,
                    "kv_block_tokens": KV_BLOCK_SIZE,
                    "kv_events_endpoint": f"tcp://127.0.0.1:{events_port}",
                }
            ],
            "remote_regions": [],
        }
        table_path = tmp_path_factory.mktemp("exact-edge") / "table.json"
        table_path.write_text(json.dumps(table))
        edge = start_edge(
            "edge-exact",
            table_path,
            "--region",
            "cpu-lab",
            "--tokenizer",
            f"{SERVED_MODEL}={tiny_model}",
            healthy_instances=1,
        )
        time.sleep(1.0)  # the SUB socket joins before the first event (seq 0)
        yield edge
    finally:
        if edge is not None:
            edge.stop()
        server.stop()


def ask(edge: EdgeProcess, path: str, body: dict[str, Any]) -> tuple[int, int, int]:
    """(cached tokens the edge predicted, cached tokens vLLM reported, prompt tokens)."""
    body = {"model": SERVED_MODEL, "max_tokens": 1, "temperature": 0, **body}
    r = httpx.post(edge.base_url + path, json=body, timeout=120)
    assert r.status_code == 200, r.text
    route = dict(p.split("=", 1) for p in r.headers["x-fedinfer-route"].split(";") if "=" in p)
    predicted = int(dict(t.split(":") for t in route["score"].split(","))["cached"])
    usage = r.json()["usage"]
    return predicted, usage["prompt_tokens_details"]["cached_tokens"], usage["prompt_tokens"]


def metrics(edge: EdgeProcess, name: str) -> dict[str, float]:
    text = httpx.get(edge.ops_url + "/metrics", timeout=5).text
    return {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name)
    }


def settle(edge: EdgeProcess) -> None:
    """Until the engine's events of the last request are in (its cached tokens stop moving),
    and this edge's own recent routing no longer counts (only the events decide)."""
    time.sleep(RECENT_S)
    last = None
    for _ in range(50):
        held = sum(metrics(edge, "fedinfer_edge_kv_engine_cached_tokens").values())
        if held > 0 and held == last:
            return
        last = held
        time.sleep(0.2)
    raise AssertionError(f"the engine's KV events did not settle (held {last})")


def exact_equal(edge: EdgeProcess) -> float:
    return sum(
        v
        for k, v in metrics(edge, "fedinfer_edge_cached_predictions_total").items()
        if 'path="exact"' in k and 'outcome="equal"' in k
    )


def chat(system: str, user: str, **extra: Any) -> dict[str, Any]:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
    return {"messages": messages, **extra}


def test_predicted_cached_tokens_equal_vllms_for_shared_chat_prefixes(
    exact_edge: EdgeProcess,
) -> None:
    system = shared_prefix(200)
    ask(exact_edge, "/v1/chat/completions", chat(system, "first question about routing"))
    settle(exact_edge)
    before = exact_equal(exact_edge)
    seen = []
    for i, user in enumerate(("second one", "a third, rather longer question here", "4")):
        predicted, actual, prompt = ask(exact_edge, "/v1/chat/completions", chat(system, user))
        seen.append((predicted, actual))
        assert actual >= 2 * KV_BLOCK_SIZE, (i, actual, prompt)  # the system prompt is shared
        assert predicted == actual, seen
        settle(exact_edge)
    assert exact_equal(exact_edge) - before == 3  # predicted by the exact path, not estimated

    # A salt keeps vLLM from sharing the blocks; the edge hashes it into the first block too.
    predicted, actual, _ = ask(
        exact_edge, "/v1/chat/completions", chat(system, "second one", cache_salt="s1")
    )
    assert (predicted, actual) == (0, 0)
    settle(exact_edge)
    predicted, actual, _ = ask(
        exact_edge, "/v1/chat/completions", chat(system, "salted again", cache_salt="s1")
    )
    assert predicted == actual >= 2 * KV_BLOCK_SIZE


def test_predicted_cached_tokens_equal_vllms_for_completions_and_token_ids(
    exact_edge: EdgeProcess,
) -> None:
    head = shared_prefix(300).replace("route", "forward")  # not the chat test's prefix
    predicted, actual, _ = ask(exact_edge, "/v1/completions", {"prompt": head + " alpha"})
    assert actual == 0
    settle(exact_edge)
    predicted, actual, prompt = ask(exact_edge, "/v1/completions", {"prompt": head + " beta"})
    assert actual >= 2 * KV_BLOCK_SIZE and predicted == actual, (predicted, actual, prompt)
    settle(exact_edge)

    # Token ids: the edge takes them as they are; the first 3 blocks are shared.
    tok = httpx.post(
        exact_edge.base_url + "/tokenize",
        json={"model": SERVED_MODEL, "prompt": head + " gamma delta"},
        timeout=30,
    ).json()["tokens"]
    assert len(tok) > 3 * KV_BLOCK_SIZE
    ids = [*tok[: 3 * KV_BLOCK_SIZE], 5, 6, 7]
    predicted, actual, _ = ask(exact_edge, "/v1/completions", {"prompt": ids})
    assert predicted == actual
    settle(exact_edge)
    predicted, actual, _ = ask(exact_edge, "/v1/completions", {"prompt": [*ids[:-1], 9, 10]})
    assert predicted == actual == 3 * KV_BLOCK_SIZE
