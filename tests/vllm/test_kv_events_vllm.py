"""The edge consuming a real vLLM 0.32's KV-cache events (``make test-vllm``).

One vLLM CPU server with a 12-block cache (1 536 tokens) publishes its events over ZMQ; the
edge subscribes. Distinct ~700-token prompts force evictions; the first prompt, evicted, is
then sent again: the edge predicts what vLLM reports (0 cached tokens) instead of a hit.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from regions.edge.view.kv_events import CHECK_INTERVAL_S, SETTLE_S
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

pytestmark = pytest.mark.vllm

NUM_BLOCKS = 12


@pytest.fixture(scope="module")
def kv_edge(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EdgeProcess]:
    """A vLLM server publishing KV events on a free port, and an edge subscribed to them."""
    events_port = free_port()
    config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        # loopback only; "::" makes vLLM bind (not connect), libzmq binds it as 127.0.0.1
        "endpoint": f"tcp://[::ffff:127.0.0.1]:{events_port}",
        "topic": "kv-events",
    }
    extra_args = ("--kv-events-config", json.dumps(config))
    extra_args += ("--num-gpu-blocks-override", str(NUM_BLOCKS))
    cpu = sorted(os.sched_getaffinity(0))[0]
    server = start_server("vllm-kv", tiny_model, cpu, extra_args)
    edge: EdgeProcess | None = None
    try:
        wait_healthy([server])
        table = {
            "schema_version": 1,
            "version": 1,
            "region": "cpu-lab",
            "generated_at": "2026-11-29T12:00:00Z",
            "instances": [
                {
                    "id": "vllm-kv",
                    "url": server.base_url,
                    "model": SERVED_MODEL,
                    "kv_block_tokens": KV_BLOCK_SIZE,
                    "kv_events_endpoint": f"tcp://127.0.0.1:{events_port}",
                }
            ],
            "remote_regions": [],
        }
        table_path = tmp_path_factory.mktemp("kv-edge") / "table.json"
        table_path.write_text(json.dumps(table))
        edge = start_edge("edge-kv", table_path, "--region", "cpu-lab", healthy_instances=1)
        time.sleep(1.0)  # the SUB socket joins before the first event (seq 0)
        yield edge
    finally:
        if edge is not None:
            edge.stop()
        server.stop()


def ask(edge: EdgeProcess, i: int) -> tuple[int, int, int]:
    """(cached tokens the edge predicted, cached tokens vLLM reported, prompt tokens)."""
    body = {
        "model": SERVED_MODEL,
        "messages": [{"role": "user", "content": f"[doc {i}] {shared_prefix(450)}"}],
        "max_tokens": 1,
        "temperature": 0,
    }
    r = httpx.post(edge.base_url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    route = dict(p.split("=", 1) for p in r.headers["x-fedinfer-route"].split(";") if "=" in p)
    predicted = int(dict(t.split(":") for t in route["score"].split(","))["cached"])
    usage = r.json()["usage"]
    return predicted, usage["prompt_tokens_details"]["cached_tokens"], usage["prompt_tokens"]


def metric(edge: EdgeProcess, name: str) -> float:
    text = httpx.get(edge.ops_url + "/metrics", timeout=5).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


def test_real_vllm_events_stop_the_edge_predicting_evicted_prefixes(kv_edge: EdgeProcess) -> None:
    n = 5
    for i in range(n):
        predicted, actual, prompt = ask(kv_edge, i)
        assert (predicted, actual) == (0, 0)
        assert 3 * KV_BLOCK_SIZE < prompt < 1024  # 5 prompts cannot fit in 12 blocks
    time.sleep(SETTLE_S + 3 * CHECK_INTERVAL_S)
    held = metric(kv_edge, "fedinfer_edge_kv_engine_cached_tokens")
    assert 0 < held <= NUM_BLOCKS * KV_BLOCK_SIZE  # -1 would mean vLLM's stream was not seen
    assert metric(kv_edge, "fedinfer_edge_kv_event_gaps_total") == 0

    predicted, actual, _ = ask(kv_edge, n - 1)  # the latest is still held
    assert predicted > 0 and actual >= 3 * KV_BLOCK_SIZE
    predicted, actual, _ = ask(kv_edge, 0)  # long evicted
    assert (predicted, actual) == (0, 0)
    assert metric(kv_edge, "fedinfer_edge_kv_event_evicted_blocks_total") > 0
