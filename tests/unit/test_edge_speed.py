"""Self-calibrating prefill speeds (pure, and as the load board keeps them per kind): a wrong
table figure is learned away in a few answers and followed in full, outliers move it little,
bounds hold, the edge's own overhead teaches nothing, noise does not rank identical engines,
and one engine slower than its kind is told apart."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from regions.edge.load import LoadBoard
from regions.edge.speed import (
    GAIN,
    HYSTERESIS,
    MAX_SCALE,
    MAX_STEP,
    MIN_S,
    answer_scale,
    deviation_in_use,
    in_use,
    learned,
)

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
