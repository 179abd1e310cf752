"""Step-time model: realistic orders of magnitude, monotonic, accelerator and TP scaling."""

from __future__ import annotations

import itertools

import pytest

from regions.engines.accelerators import ACCELERATORS, accelerator
from regions.engines.simulator.perf import PerfModel, model_params_billion

H100 = PerfModel(accelerator("H100-80G"))


def test_8b_on_one_h100_is_in_published_ranges() -> None:
    assert 10_000 <= H100.prefill_tokens_per_second() <= 20_000
    assert 0.008 <= H100.step_time(0, 1, 500) <= 0.015
    assert 0.010 <= H100.step_time(0, 64, 64 * 2000) <= 0.030
    assert 20_000 <= H100.default_num_gpu_blocks() <= 30_000  # vLLM reports ~27k


def test_step_time_is_monotonic_in_every_input() -> None:
    grid = [0, 1, 7, 64, 512, 8192]
    for p, d, k, a in itertools.product(grid, grid, grid, grid):
        if p == 0 and d == 0:
            assert H100.step_time(p, d, k, a) == 0.0
            continue
        t = H100.step_time(p, d, k, a)
        assert H100.step_time(p + 1, d, k, a) > t
        assert H100.step_time(p, d + 1, k, a) > t
        assert H100.step_time(p, d, k + 1, a) > t
        assert H100.step_time(p, d, k, a + 1) > t


def test_faster_accelerators_take_less_time_and_tp_helps_sublinearly() -> None:
    by_speed = sorted(ACCELERATORS.values(), key=lambda a: a.speed)
    times = [PerfModel(a).step_time(2048, 32, 32 * 1000) for a in by_speed]
    assert times == sorted(times, reverse=True)
    one = PerfModel(accelerator("H100-80G"), tp=1).step_time(4096, 0)
    two = PerfModel(accelerator("H100-80G"), tp=2).step_time(4096, 0)
    eight = PerfModel(accelerator("H100-80G"), tp=8).step_time(4096, 0)
    assert one / 2 < two < one
    assert one / 8 < eight < two


def test_bigger_models_are_slower_and_need_memory() -> None:
    big = PerfModel(accelerator("H100-80G"), tp=4, params_billion=70)
    assert big.step_time(0, 1, 100) > H100.step_time(0, 1, 100)
    with pytest.raises(ValueError, match="does not fit"):
        PerfModel(accelerator("L4"), params_billion=70).default_num_gpu_blocks()


def test_names_and_validation() -> None:
    assert model_params_billion("meta-llama/Llama-3.1-70B-Instruct") == 70
    assert model_params_billion("mistralai/Mixtral-8x7B-v0.1") == 56
    assert model_params_billion("Qwen/Qwen2.5-0.5B") == 0.5
    assert model_params_billion("tiny-llama") == 8.0
    with pytest.raises(ValueError, match="known"):
        accelerator("TPU-v5")
    with pytest.raises(ValueError):
        PerfModel(accelerator("B200"), tp=0)
