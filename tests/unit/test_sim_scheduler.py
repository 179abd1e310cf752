"""Continuous batching after vLLM v1: budgets, chunked prefill, prefix hits, preemption."""

from __future__ import annotations

import pytest

from regions.engines.simulator.kv_cache import KVCacheManager, root_hash
from regions.engines.simulator.scheduler import (
    Request,
    Scheduler,
    SchedulerConfig,
    Status,
)

BS = 16


def make(
    num_blocks: int = 1024,
    max_num_seqs: int = 256,
    budget: int = 8192,
    max_model_len: int = 4096,
    max_loras: int = 4,
) -> Scheduler:
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        max_model_len=max_model_len,
        block_size=BS,
        max_loras=max_loras,
    )
    return Scheduler(config, KVCacheManager(num_blocks, BS), root_hash(0))


def req(
    rid: str, prompt: list[int] | int, out: int = 4, max_tokens: int | None = None, lora=None
) -> Request:
    tokens = list(range(1, prompt + 1)) if isinstance(prompt, int) else prompt
    return Request(
        request_id=rid,
        prompt_token_ids=tokens,
        planned_output_ids=[50_000 + i for i in range(out)],
        max_tokens=out if max_tokens is None else max_tokens,
        lora=lora,
    )


def run(s: Scheduler, max_steps: int = 10_000) -> list[list[tuple[str, int]]]:
    """Step until idle; the trace of (request id, tokens) per step."""
    trace = []
    for _ in range(max_steps):
        if not s.has_work():
            return trace
        plan = s.schedule()
        assert plan.num_scheduled_tokens <= s.config.max_num_batched_tokens
        assert s.num_running <= s.config.max_num_seqs
        trace.append([(r.request_id, n) for r, n in plan.scheduled])
        s.update(plan)
    raise AssertionError("scheduler did not drain")


def test_a_request_prefills_then_decodes_one_token_per_step() -> None:
    s = make()
    r = req("a", 40, out=3)
    s.add_request(r)
    assert run(s) == [[("a", 40)], [("a", 1)], [("a", 1)]]
    assert r.output_token_ids == [50_000, 50_001, 50_002]
    assert r.finish_reason == "length"
    assert s.kv.num_free_blocks == s.kv.num_blocks


def test_a_shorter_plan_than_max_tokens_finishes_with_stop() -> None:
    s = make()
    r = req("a", 20, out=2, max_tokens=10)
    s.add_request(r)
    run(s)
    assert (r.finish_reason, len(r.output_token_ids)) == ("stop", 2)


def test_max_num_seqs_caps_the_batch() -> None:
    s = make(max_num_seqs=3)
    for i in range(5):
        s.add_request(req(f"r{i}", [i + 1] * 20, out=5))
    plan = s.schedule()
    assert [r.request_id for r, _ in plan.scheduled] == ["r0", "r1", "r2"]
    assert (s.num_running, s.num_waiting) == (3, 2)
    run(s)


def test_long_prompt_is_chunked_to_the_token_budget_and_samples_after_the_last_chunk() -> None:
    s = make(budget=1000, max_model_len=4096)
    r = req("long", 2500, out=2)
    s.add_request(r)
    trace = run(s)
    assert trace[:3] == [[("long", 1000)], [("long", 1000)], [("long", 500)]]
    assert r.first_token_time is not None
    assert len(trace) == 4


def test_decodes_are_scheduled_before_new_prefills() -> None:
    s = make(budget=512)
    s.add_request(req("chat", 100, out=50))
    plan = s.schedule()
    s.update(plan)
    s.add_request(req("doc", 3000, out=1))
    plan = s.schedule()
    assert plan.scheduled[0][0].request_id == "chat" and plan.scheduled[0][1] == 1
    assert plan.scheduled[1][1] == 511  # the prefill gets what the decode left
    assert (plan.num_decode_seqs, plan.num_prefill_tokens) == (1, 511)


def test_repeated_prompt_hits_the_prefix_cache_and_counts_tokens() -> None:
    s = make()
    prompt = list(range(1, 301))
    first = req("a", prompt)
    s.add_request(first)
    run(s)
    second = req("b", prompt)
    s.add_request(second)
    plan = s.schedule()
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == (300 - 1) // BS * BS == 288
    assert plan.scheduled == [(second, 12)]
    assert s.counters.prefix_cache_queries == 600
    assert s.counters.prefix_cache_hits == 288
    run(s)
    assert s.counters.prompt_tokens == 600


def test_multi_turn_conversation_reuses_generated_blocks() -> None:
    s = make()
    turn1 = req("t1", 40, out=40)
    s.add_request(turn1)
    run(s)
    history = turn1.prompt_token_ids + turn1.output_token_ids + [7, 8, 9]
    turn2 = req("t2", history)
    s.add_request(turn2)
    s.schedule()
    # 80 tokens of turn 1 were computed (the last sampled token's KV was not): 4 full blocks.
    assert turn2.num_cached_tokens == 64


def test_preemption_frees_the_newest_request_and_everything_still_finishes() -> None:
    s = make(num_blocks=12, budget=4096, max_model_len=128)
    requests = [req(f"r{i}", [i + 1] * 60, out=60) for i in range(3)]
    for r in requests:
        s.add_request(r)
    preempted = []
    for _ in range(1000):
        if not s.has_work():
            break
        plan = s.schedule()
        preempted += [r.request_id for r in plan.preempted]
        s.update(plan)
    assert preempted, "12 blocks cannot hold three 120-token sequences"
    assert preempted[0] == "r2"  # the newest running request goes first (FCFS policy)
    assert all(r.status is Status.FINISHED and len(r.output_token_ids) == 60 for r in requests)
    assert s.counters.preemptions == len(preempted)
    assert s.kv.num_free_blocks == 12


def test_waiting_request_that_does_not_fit_waits_without_preempting() -> None:
    s = make(num_blocks=8, max_model_len=128)
    s.add_request(req("a", 100, out=20))
    s.schedule()
    s.add_request(req("b", 100, out=20))
    plan = s.schedule()
    assert [r.request_id for r, _ in plan.scheduled] == ["a"]
    assert plan.preempted == [] and s.num_waiting == 1


def test_abort_frees_blocks_wherever_the_request_is() -> None:
    s = make(max_num_seqs=1)
    s.add_request(req("run", 64, out=100, max_tokens=100))
    s.add_request(req("wait", 64, out=5))
    s.update(s.schedule())
    assert s.kv.num_free_blocks < s.kv.num_blocks
    aborted = s.abort("run")
    assert aborted is not None and aborted.finish_reason == "abort"
    assert s.abort("wait") is not None
    assert s.abort("wait") is None  # already gone
    assert s.kv.num_free_blocks == s.kv.num_blocks and not s.has_work()


def test_max_loras_limits_adapters_per_batch_without_blocking_others() -> None:
    s = make(max_loras=1)
    s.add_request(req("a", [1] * 20, lora="x"))
    s.add_request(req("b", [2] * 20, lora="y"))
    s.add_request(req("c", [3] * 20))
    plan = s.schedule()
    assert [r.request_id for r, _ in plan.scheduled] == ["a", "c"]
    assert [r.request_id for r in s.waiting] == ["b"]
    run(s)


def test_invalid_requests_and_configs_are_refused() -> None:
    s = make(max_model_len=100)
    with pytest.raises(ValueError):
        s.add_request(req("x", 90, out=20))
    with pytest.raises(ValueError):
        s.add_request(req("e", []))
    s.add_request(req("d", 10))
    with pytest.raises(ValueError):
        s.add_request(req("d", 10))
    with pytest.raises(ValueError):
        make(num_blocks=4, max_model_len=4096)


def test_same_workload_same_trace() -> None:
    def trace() -> tuple[list[list[tuple[str, int]]], list[int]]:
        s = make(num_blocks=40, budget=256, max_num_seqs=4, max_model_len=512)
        reqs = [req(f"r{i}", [i % 3 + 1] * (50 + 37 * i), out=10 + i) for i in range(8)]
        for r in reqs:
            s.add_request(r)
        return run(s), [r.num_cached_tokens for r in reqs]

    assert trace() == trace()


def test_with_vllms_root_blocks_hash_as_vllms_sha256_cbor_prompt_and_output_alike() -> None:
    """``--prefix-caching-hash-algo sha256_cbor``: the hashes vLLM 0.32 computes
    (regions/engines/block_hash.py, checked against vLLM), salted and LoRA-keyed as vLLM keys
    them, extended over generated tokens as the sequence grows."""
    from regions.engines.block_hash import block_hashes, extend_chain, none_hash

    config = SchedulerConfig(
        max_num_seqs=8, max_num_batched_tokens=8192, max_model_len=4096, block_size=BS
    )
    root = none_hash()
    s = Scheduler(config, KVCacheManager(256, BS), root_hash(0), root, {"sql": "/adapters/sql"})
    plain = req("plain", 40, out=20)
    salted = req("salted", 40)
    salted.cache_salt = "t:abc"
    adapter = req("adapter", 40, lora="sql")
    for r in (plain, salted, adapter):
        s.add_request(r)
    ids = list(range(1, 41))
    assert plain.block_hashes == block_hashes(ids, BS, root)
    assert salted.block_hashes == block_hashes(ids, BS, root, cache_salt="t:abc")
    lora: list[int] = []
    extend_chain([], lora, ids, BS, root, lora=("sql", "/adapters/sql"))
    assert adapter.block_hashes == lora
    run(s)
    # the answer's tokens filled more blocks: hashed on, from the prompt's chain
    assert plain.block_hashes == block_hashes(plain.all_token_ids(), BS, root)
    assert len(plain.block_hashes) == 60 // BS
