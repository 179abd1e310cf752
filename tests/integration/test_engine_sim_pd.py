"""P/D disaggregation between two simulated engines, with vLLM's ``kv_transfer_params`` over
real sockets: the prefill leg holds its blocks, the decode leg reads them instead of computing."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.test_engine_sim import MODEL, Sim, engine_sim

PREFILL_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
SYSTEM = "You answer questions about the quarterly sales report, briefly. " * 40


@pytest.fixture(scope="module")
def sim() -> Iterator[Sim]:
    with engine_sim("--num-gpu-blocks", "2048", "--max-model-len", "8192", "--seed", "5") as s:
        yield s


def metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics").text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                return float(sample.value)
    raise AssertionError(f"{name} not exported")


def chat(url: str, body: dict[str, Any]) -> dict[str, Any]:
    resp = httpx.post(url + "/v1/chat/completions", json=body, timeout=15)
    assert resp.status_code == 200, resp.text
    out: dict[str, Any] = resp.json()
    return out


def test_prefill_leg_then_decode_leg_skips_the_prompt(sim: Sim) -> None:
    p, d = sim.urls
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Q3?"}]
    base = {"model": MODEL, "messages": messages, "max_tokens": 12, "ignore_eos": True}
    hits_before = metric(d, "vllm:external_prefix_cache_hits_total")
    steps_before = metric(d, "vllm:iteration_tokens_total_sum")

    first = chat(p, {**base, "max_tokens": 1, "kv_transfer_params": PREFILL_PARAMS})
    params = first["kv_transfer_params"]
    prompt = first["usage"]["prompt_tokens"]
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert params["remote_host"] == "127.0.0.1" and p.endswith(f":{params['remote_port']}")
    assert isinstance(params["remote_engine_id"], str) and params["remote_block_ids"]
    assert len(params["remote_block_ids"]) == -(-(prompt + 1) // 16)

    answer = chat(d, {**base, "kv_transfer_params": params})
    assert answer["kv_transfer_params"] is None
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == prompt - 1
    # The decode engine computed one prompt token and the 12 output tokens, not the prompt.
    assert metric(d, "vllm:external_prefix_cache_hits_total") - hits_before == prompt - 1
    assert metric(d, "vllm:iteration_tokens_total_sum") - steps_before <= 1 + 12
    # Same prompt, same answer as a single engine computing everything.
    alone = chat(p, base)
    assert alone["choices"][0]["message"] == answer["choices"][0]["message"]

    # The blocks were released by the read: a second read of the same params fails, and the
    # decode engine then computes the prompt itself (vLLM's recompute policy).
    failed_before = metric(d, "vllm:nixl_num_failed_transfers_total")
    again = chat(
        d,
        {
            **base,
            "messages": [*messages[:1], {"role": "user", "content": "Q4?"}],
            "kv_transfer_params": params,
        },
    )
    assert again["choices"][0]["finish_reason"] == "length"
    assert metric(d, "vllm:nixl_num_failed_transfers_total") == failed_before + 1


def test_plain_requests_are_unchanged(sim: Sim) -> None:
    p, _ = sim.urls
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
    assert chat(p, body)["kv_transfer_params"] is None
    resp = httpx.post(
        p + "/v1/completions",
        json={"model": MODEL, "prompt": "Hi", "max_tokens": 1, "kv_transfer_params": [1]},
    )
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "body.kv_transfer_params"


def test_an_engine_without_a_connector_ignores_the_params() -> None:
    with engine_sim(
        "--num-gpu-blocks", "512", "--max-model-len", "2048", "--kv-role", "none", count=1
    ) as plain:
        body = {
            "model": MODEL,
            "prompt": "Tell me about the weather in Paris",
            "max_tokens": 1,
            "kv_transfer_params": PREFILL_PARAMS,
        }
        resp = httpx.post(plain.urls[0] + "/v1/completions", json=body, timeout=15)
        assert resp.status_code == 200 and resp.json()["kv_transfer_params"] is None
        assert metric(plain.urls[0], "vllm:kv_cache_usage_perc") == 0.0  # nothing held
