"""Engine-level determinism and configuration, without sockets."""

from __future__ import annotations

import asyncio

import pytest

from regions.engines.simulator.engine import EngineConfig, SimEngine
from regions.engines.simulator.tokenizer import EOS_TOKEN_ID, OutputPlanner, Tokenizer


def answers(seed: int, prompts: list[list[int]], **kw: object) -> list[list[int]]:
    engine = SimEngine(EngineConfig(seed=seed, num_gpu_blocks=512, max_model_len=2048))
    return [engine.new_request(p, 64, **kw)[0].planned_output_ids for p in prompts]  # type: ignore[arg-type]


def test_same_seed_same_answers_and_other_seeds_differ() -> None:
    prompts = [[1, 2, 3], [1, 2, 4], list(range(500))]
    assert answers(1, prompts) == answers(1, prompts)
    assert answers(1, prompts) != answers(2, prompts)
    a, b, _ = answers(1, prompts)
    assert a != b  # different prompts, different answers
    assert [len(x) for x in answers(1, prompts, ignore_eos=True)] == [64, 64, 64]


def test_natural_lengths_follow_the_median() -> None:
    planner = OutputPlanner(Tokenizer(), seed=0, median=100)
    lengths = sorted(planner.natural_lengths)
    assert 85 <= lengths[len(lengths) // 2] <= 115
    ids, texts = planner.plan(12345, 70_000, ignore_eos=True)  # longer than the stream
    assert len(ids) == len(texts) == 70_000
    assert planner.plan(7, 10, min_tokens=10)[0] == planner.plan(7, 10, min_tokens=10)[0]


def test_a_run_through_the_engine_loop_is_deterministic() -> None:
    async def run(seed: int) -> list[tuple[int, int, str | None]]:
        engine = SimEngine(
            EngineConfig(seed=seed, accelerator="B200", num_gpu_blocks=64, max_model_len=512)
        )
        loop = asyncio.ensure_future(engine.run())
        streams = []
        for i in range(6):
            request, texts = engine.new_request([i % 2 + 1] * (100 + 30 * i), 40)
            streams.append(engine.submit(request, texts))
        for _ in range(2000):
            if all(s.finished for s in streams):
                break
            await asyncio.sleep(0.005)
        engine.close()
        await loop
        assert engine.kv.num_free_blocks == 64
        return [
            (len(s.request.output_token_ids), s.request.num_cached_tokens, s.request.finish_reason)
            for s in streams
        ]

    first = asyncio.run(run(5))
    assert first == asyncio.run(run(5))
    assert any(cached > 0 for _, cached, _ in first)  # repeated prompt heads hit the cache


def test_impossible_configurations_fail_clearly() -> None:
    with pytest.raises(ValueError, match="KV blocks"):
        SimEngine(EngineConfig(num_gpu_blocks=10, max_model_len=4096))
    with pytest.raises(ValueError, match="does not fit"):
        SimEngine(EngineConfig(model="meta-llama/Llama-3.1-405B", accelerator="L4"))
    engine = SimEngine(EngineConfig(accelerator="L4"))
    assert engine.max_model_len == min(32768, engine.num_gpu_blocks * 16)
    assert engine.system_fingerprint.startswith("vllm-0.32.0-")
    assert "tp2" in SimEngine(EngineConfig(tp=2)).system_fingerprint


def test_an_answer_that_stops_by_itself_ends_with_the_end_of_turn_token() -> None:
    engine = SimEngine(EngineConfig(output_len_median=5, num_gpu_blocks=512, max_model_len=2048))
    request, texts = engine.new_request([1, 2, 3], 1000)
    assert request.planned_output_ids[-1] == EOS_TOKEN_ID and texts[-1] == ""
    forced, _ = engine.new_request([1, 2, 3], 1000, ignore_eos=True)
    assert len(forced.planned_output_ids) == 1000 and EOS_TOKEN_ID not in forced.planned_output_ids
