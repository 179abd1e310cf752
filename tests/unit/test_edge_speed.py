"""Self-calibrating prefill speeds (pure, and as the load board keeps them per kind): a wrong
table figure is learned away in a few answers and followed in full, outliers move it little,
bounds hold, the edge's own overhead teaches nothing, noise does not rank identical engines,
one engine slower than its kind is told apart, and the decode step, measured from the engines'
own histograms, is not learned into the rate."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from regions.edge.policy.scheduler import Candidate, RouteRequest, SchedulerConfig, score
from regions.edge.policy.speed import (
    GAIN,
    HYSTERESIS,
    MAX_SCALE,
    MAX_STEP,
    MIN_GAPS,
    MIN_S,
    STEP_GAIN,
    answer_scale,
    deviation_in_use,
    full_batch_step,
    in_use,
    learned,
    smoothed,
    step_at,
    step_interval,
)
from regions.edge.view.load import LoadBoard
from regions.engines.metrics import EngineLoad

KIND = ("sim-llama-8b", 10_000.0)


def teach(board: LoadBoard, true_speeds: dict[str, float], answers: int, noise: float = 0.0,
          seed: int = 1) -> None:  # fmt: skip
    """``answers`` answers per instance, round robin: each predicted at the scale in use,
    observed at the instance's true one (times some noise)."""
    rand = random.Random(seed)
    for _ in range(answers):
        for instance, true_speed in true_speeds.items():
            used = board.get(instance).speed
            observed = 0.2 / true_speed * (1 + rand.uniform(-noise, noise))
            board.learn(instance, 0.2 / used, observed)


def board_of(*instances: str) -> LoadBoard:
    board = LoadBoard()
    board.sync(dict.fromkeys(instances, KIND))
    return board


@pytest.mark.parametrize("true_speed", [0.2, 0.5, 2.0, 5.0])
def test_a_table_figure_off_by_up_to_five_times_is_learned_in_three_answers_each(
    true_speed: float,
) -> None:
    board = board_of("a", "b", "c")
    teach(board, dict.fromkeys("abc", true_speed), 3)
    for instance in "abc":
        assert board.get(instance).speed == pytest.approx(true_speed, rel=1e-9)


def test_the_kind_follows_a_figure_wrong_for_all_of_it_in_full_not_a_band_off() -> None:
    """A band on the scale itself left it resting up to 15 % off the learned one."""
    board = board_of("a", "b")
    teach(board, {"a": 0.2, "b": 0.2}, 200, noise=0.3)
    for instance in "ab":
        load = board.get(instance)
        assert load.deviation == 1.0
        assert load.speed == pytest.approx(0.2, rel=0.05)
    assert board.get("a").speed == board.get("b").speed


def test_noise_around_one_speed_does_not_rank_identical_engines() -> None:
    for seed in range(20):
        board = board_of(*"abcd")
        teach(board, dict.fromkeys("abcd", 1.0), 500, noise=0.3, seed=seed)
        assert len({board.get(i).speed for i in "abcd"}) == 1, seed


def test_one_engine_slower_than_its_kind_is_told_apart() -> None:
    board = board_of(*"abcd")
    teach(board, {"a": 1.0, "b": 1.0, "c": 1.0, "d": 0.5}, 200, noise=0.1)
    fast = {board.get(i).speed for i in "abc"}
    assert len(fast) == 1
    assert board.get("d").speed / fast.pop() == pytest.approx(0.5, rel=HYSTERESIS - 1)


def test_an_instance_that_taught_nothing_takes_its_kinds_speed_and_other_kinds_keep_theirs() -> (
    None
):
    board = LoadBoard()
    board.sync({"a": KIND, "b": KIND, "other": ("sim-llama-70b", 2_000.0)})
    teach(board, {"a": 0.5}, 20)
    assert board.get("b").speed == pytest.approx(0.5)
    assert board.get("b").taught == 0
    assert board.get("other").speed == 1.0


def test_answers_that_teach_nothing_are_not_counted() -> None:
    board = board_of("a")
    board.learn("a", MIN_S / 2, 0.5)
    board.learn("unknown", 0.2, 0.1)
    assert (board.get("a").taught, board.get("a").speed) == (0, 1.0)


def test_the_first_answers_weigh_as_a_running_mean_then_gain_per_answer() -> None:
    assert learned(1.0, 1.2, taught=0) == pytest.approx((1.2, 1))
    assert learned(1.2, 1.0, taught=1) == pytest.approx((1.2**0.5, 2))
    assert learned(1.0, 1.2, taught=1000) == pytest.approx((1.2**GAIN, 1001))
    assert learned(1.0, 1.2, taught=1000, gain=GAIN / 8)[0] == pytest.approx(1.2 ** (GAIN / 8))


def test_a_step_at_its_bound_is_not_counted_so_the_running_mean_starts_near_the_scale() -> None:
    assert learned(1.0, 5.0, taught=0) == (MAX_STEP, 0)
    assert learned(1.0, 0.2, taught=3) == (1 / MAX_STEP, 3)


def test_one_outlier_moves_the_scale_at_most_one_bounded_step() -> None:
    said = answer_scale(1.0, 0.1, 100.0)
    assert said is not None
    assert learned(1.0, said, taught=0)[0] == pytest.approx(1 / MAX_STEP)
    assert learned(1.0, 10.0, taught=100)[0] == pytest.approx(10**GAIN)


def test_the_edges_own_overhead_says_nothing() -> None:
    assert answer_scale(1.0, MIN_S / 2, 0.5) is None
    assert answer_scale(1.0, 0.5, MIN_S / 2) is None
    assert answer_scale(2.0, 0.5, 0.25) == 4.0


def test_the_scale_in_use_moves_only_out_of_its_band() -> None:
    assert in_use(1.0, 1.1) == 1.0
    assert in_use(1.0, 1.3) == 1.3
    assert in_use(1.3, 1.2) == 1.3
    assert deviation_in_use(1.0, 1.1) == 1.0
    assert deviation_in_use(1.0, 1.2) == 1.2
    assert deviation_in_use(1.2, 1.1) == 1.2
    assert deviation_in_use(1.2, 1.05) == 1.0


@given(
    st.floats(1 / MAX_SCALE, MAX_SCALE),
    st.floats(1e-6, 1e6),
    st.integers(0, 100),
)
def test_the_scale_stays_within_its_bounds(scale: float, said: float, taught: int) -> None:
    after, counted = learned(scale, said, taught)
    assert counted in (taught, taught + 1)
    assert 1 / MAX_SCALE <= after <= MAX_SCALE
    assert scale / MAX_STEP - 1e-12 <= after <= scale * MAX_STEP + 1e-12


def test_a_new_table_keeps_what_the_kinds_learned() -> None:
    board = board_of(*"abcd")
    teach(board, dict.fromkeys("abcd", 0.2), 40)
    board.sync({**dict.fromkeys("abcde", KIND)})
    teach(board, dict.fromkeys("abcde", 0.2), 1)
    for instance in "abcde":
        assert board.get(instance).speed == pytest.approx(0.2, rel=0.01)
        assert board.get(instance).deviation == 1.0


def test_identical_engines_never_deviate_while_their_kind_learns() -> None:
    """As each becomes known its deviation is judged against the median of the known ones,
    never against a median taken before any was known."""
    board = board_of(*"abcd")
    for _ in range(60):
        teach(board, dict.fromkeys("abcd", 0.2), 1)
        assert {board.get(i).deviation for i in "abcd"} == {1.0}
    assert board.get("a").speed == pytest.approx(0.2, rel=1e-9)


def test_the_step_is_the_engines_own_mean_gap_between_readings() -> None:
    assert step_interval((0.0, 0), (1.0, 100)) == ((1.0, 100), pytest.approx(0.01))
    # Too few gaps since: wait for more, from the same reading.
    assert step_interval((1.0, 100), (1.1, 100 + MIN_GAPS - 1)) == ((1.0, 100), None)
    # Then the whole interval's mean.
    assert step_interval((1.0, 100), (5.0, 300)) == ((5.0, 300), pytest.approx(0.02))
    # The engine restarted (its count went down): start again there.
    assert step_interval((5.0, 300), (0.5, 40)) == ((0.5, 40), None)
    # A mean no step can have is not taken.
    assert step_interval((0.0, 0), (1e6, 100)) == ((1e6, 100), None)
    assert smoothed(0.0, 0.01) == 0.01
    assert smoothed(0.01, 0.02) == pytest.approx(0.01 + STEP_GAIN * 0.01)


def test_steps_measured_at_any_batch_are_kept_as_a_full_batchs() -> None:
    full = full_batch_step(0.010, 0.25, 1.0)  # a quarter-full batch stepped 10 ms
    assert full == pytest.approx(0.016)
    assert step_at(full, 0.25, 1.0) == pytest.approx(0.010)
    assert step_at(full, 2.0, 1.0) == pytest.approx(full)  # past the cap: a full batch


def reading(itl_sum: float, gaps: int, running: int = 16) -> EngineLoad:
    return EngineLoad(
        num_requests_running=running,
        inter_token_latency_seconds_sum=itl_sum,
        inter_token_latency_seconds_count=gaps,
    )


def test_the_board_measures_steps_per_kind_and_skips_shared_readings() -> None:
    board = LoadBoard()
    board.sync(dict.fromkeys("abc", KIND), dict.fromkeys("abc", 16))
    board.scraped("a", reading(0.0, 0), 0.0)
    board.scraped("a", reading(1.3, 100), 0.5)  # where the first interval starts
    assert board.full_step("a") == 0.0  # nothing measured yet: derived from the rate
    board.scraped("a", reading(2.6, 200), 1.0)
    # Measured on one member, used by all: none looks slower or faster for not being measured.
    assert [board.full_step(i) for i in "abc"] == [pytest.approx(0.013)] * 3
    board.get("a").shared(EngineLoad(num_requests_running=16), 1.0)  # a peer's: no histogram
    assert board.get("a").itl_seen == (2.6, 200)
    board.scraped("a", reading(2.6 + 0.013 * 100, 300), 1.5)  # spans the shared reading
    assert board.full_step("a") == pytest.approx(0.013)
    # Noise between identical engines does not rank them: the kind's median is used by each.
    for instance, itl_sum in (("b", 1.25), ("c", 1.40)):
        board.scraped(instance, reading(0.0, 1), 0.0)
        board.scraped(instance, reading(itl_sum, 101), 0.5)
    assert [board.full_step(i) for i in "abc"] == [pytest.approx(0.013)] * 3
    # Without the table's cap an instance's step is not measured.
    bare = board_of("z")
    bare.scraped("z", reading(0.0, 1), 0.0)
    bare.scraped("z", reading(1.3, 101), 0.5)
    assert bare.full_step("z") == 0.0


def test_a_step_the_rate_does_not_explain_is_not_learned_into_the_rate() -> None:
    """Engines at their full batch with a true table rate whose step is 1.3x a lone one's,
    where the rate-derived step assumes 2x (decode_slowdown 1): measured, the rate stays the
    table's; derived, the rate learned the step's error (the fast-90 benchmark's 25 %)."""
    rate, step_true, rtt = 13_700.0, 0.0105, 0.001
    cfg = SchedulerConfig()
    req = RouteRequest(model="m", prompt_tokens=4_000, block_tokens=16.0)

    def learned_rate(step_measured: float) -> float:
        board = board_of("a")
        for _ in range(200):
            cand = Candidate(
                id="a", model="m", adapters=(), role="mixed", state="ready", healthy=True,
                max_concurrency=16, prefill_tokens_per_s=rate * board.get("a").speed,
                inflight=15, outstanding=15, waiting=0, kv_usage=0.5, pending_tokens=0.0,
                mean_uncached_tokens=300.0, mean_service_s=0.5, cached_tokens=3_700,
                rtt_ms=rtt * 1000, full_step_s=step_measured,
            )  # fmt: skip
            s = score(cand, req, cfg)
            # Half a step's wait, then its step, at the batch it joins.
            observed = rtt + 300 / rate + 1.5 * step_at(step_true, 15 / 16, cfg.decode_slowdown)
            board.learn("a", s.ttft_s - s.fixed_s, observed - s.fixed_s)
        return rate * board.get("a").speed

    assert learned_rate(step_true) == pytest.approx(rate, rel=0.01)
    assert learned_rate(0.0) > 1.2 * rate
