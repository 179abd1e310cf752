"""P/D disaggregation in the simulator's pure core: held prefill blocks, transferred tokens
counted as computed, the transfer-time model and the side-channel read."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from regions.engines.simulator.kv_cache import KVCacheManager, root_hash
from regions.engines.simulator.kv_transfer import (
    KVTransferConfig,
    KVTransferError,
    read_remote,
    request_params,
)
from regions.engines.simulator.scheduler import Request, Scheduler, SchedulerConfig, Status

BS = 16


def make(num_blocks: int = 256) -> Scheduler:
    cfg = SchedulerConfig(max_num_batched_tokens=8192, max_model_len=2048, block_size=BS)
    return Scheduler(cfg, KVCacheManager(num_blocks, BS), root_hash(0))


def req(rid: str, prompt: int, max_tokens: int, out: int = 8) -> Request:
    return Request(
        request_id=rid,
        prompt_token_ids=list(range(1, prompt + 1)),
        planned_output_ids=[50_000 + i for i in range(out)],
        max_tokens=max_tokens,
    )


def drain(s: Scheduler) -> list[int]:
    """Step until idle; the tokens computed per step."""
    steps = []
    while s.has_work():
        plan = s.schedule()
        steps.append(plan.num_scheduled_tokens)
        s.update(plan)
    return steps


def test_a_length_capped_prefill_leg_holds_its_blocks_until_read() -> None:
    s = make()
    leg = req("p", 100, max_tokens=1)
    leg.hold_on_finish = True
    s.add_request(leg)
    drain(s)
    assert leg.status is Status.FINISHED and leg.finish_reason == "length"
    blocks, tokens = s.held["p"]
    assert tokens == 100 and len(blocks) == 7  # 100 prompt + 1 sampled token
    assert s.kv.num_free_blocks == 256 - 7  # still referenced
    assert s.release_held("p") == 100
    assert s.kv.num_free_blocks == 256 and "p" not in s.held
    assert s.release_held("p") is None  # read once


def test_only_a_prefill_leg_holds_blocks() -> None:
    s = make()
    plain = req("plain", 100, max_tokens=1)
    stopped = req("stopped", 100, max_tokens=4, out=2)  # stops before max_tokens
    stopped.hold_on_finish = True
    s.add_request(plain)
    s.add_request(stopped)
    drain(s)
    assert s.held == {} and s.kv.num_free_blocks == 256


def test_transferred_tokens_are_not_computed_and_count_as_external_hits() -> None:
    s = make()
    d = req("d", 300, max_tokens=3)
    d.num_external_tokens = 300
    s.add_request(d)
    steps = drain(s)
    # Only the last prompt token is computed, then the decodes: no 300-token prefill step.
    assert steps == [1, 1, 1]
    assert d.num_cached_tokens == 299
    c = s.counters
    assert (c.external_prefix_cache_queries, c.external_prefix_cache_hits) == (300, 299)
    assert c.prefix_cache_hits == 0 and c.prompt_tokens == 300
    # The transferred blocks entered the local prefix cache, as vLLM caches received blocks.
    again = req("again", 300, max_tokens=1)
    s.add_request(again)
    drain(s)
    assert again.num_cached_tokens == 288  # 18 full blocks; the last token is recomputed


def test_local_hits_come_first_and_the_connector_covers_the_rest() -> None:
    s = make()
    s.add_request(req("warm", 160, max_tokens=1))
    drain(s)
    d = req("d", 320, max_tokens=1)
    d.num_external_tokens = 320
    s.add_request(d)
    drain(s)
    c = s.counters
    assert c.prefix_cache_hits == 160  # the warm request's 10 blocks
    assert c.external_prefix_cache_queries == 320 - 160
    assert c.external_prefix_cache_hits == 319 - 160


def test_without_transfer_the_whole_prompt_is_computed() -> None:
    s = make()
    s.add_request(req("d", 300, max_tokens=1))
    assert drain(s) == [300]
    assert s.counters.external_prefix_cache_queries == 0


def test_transfer_time_grows_with_size() -> None:
    cfg = KVTransferConfig(bandwidth_bytes_per_s=25e9, latency_s=0.002)
    assert cfg.transfer_time(0, 131_072) == 0.0
    assert cfg.transfer_time(1000, 131_072) == pytest.approx(0.002 + 1000 * 131_072 / 25e9)
    assert cfg.transfer_time(2000, 131_072) > cfg.transfer_time(1000, 131_072)
    assert KVTransferConfig(role=None).consumer is False
    assert KVTransferConfig(role="kv_producer").consumer is False
    assert KVTransferConfig(role="kv_consumer").producer is False
    assert KVTransferConfig().producer and KVTransferConfig().consumer


def test_request_params_must_be_an_object() -> None:
    assert request_params({}) is None
    assert request_params({"kv_transfer_params": {"do_remote_decode": True}}) == {
        "do_remote_decode": True
    }
    with pytest.raises(ValueError):
        request_params({"kv_transfer_params": [1]})


def _client(handler: httpx.MockTransport) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=handler)


def test_read_remote_returns_tokens_and_raises_on_any_failure() -> None:
    seen: list[str] = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(str(request.url))
        if request.url.port == 1:
            return httpx.Response(200, json={"num_tokens": 42})
        if request.url.port == 2:
            return httpx.Response(404, json={"detail": "no"})
        raise httpx.ConnectError("refused")

    params = {"remote_host": "127.0.0.1", "remote_engine_id": "e", "remote_request_id": "r"}

    async def go() -> None:
        async with _client(httpx.MockTransport(answer)) as client:
            assert await read_remote(client, {**params, "remote_port": 1}, 1.0) == 42
            for bad in ({**params, "remote_port": 2}, {**params, "remote_port": 3}, params):
                with pytest.raises(KVTransferError):
                    await read_remote(client, bad, 1.0)

    asyncio.run(go())
    assert seen[0] == "http://127.0.0.1:1/kv_transfer/read"
    assert len(seen) == 3  # the params without a port never reached the network
