"""Self-calibrating prefill speeds (pure): a wrong table figure is learned away, outliers move
it little, bounds hold, the edge's own overhead teaches nothing, and noise does not rank
identical engines."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from regions.edge.speed import HYSTERESIS, MAX_SCALE, MAX_STEP, MIN_S, in_use, learned


def learn(true_speed: float, answers: int, noise: float = 0.0, seed: int = 1) -> float:
    """The scale in use after ``answers`` answers of an engine ``true_speed`` times the table's
    rate: each predicted at the scale in use, observed at the true one (times some noise)."""
    rand = random.Random(seed)
    scale = used = 1.0
    for _ in range(answers):
        observed = 0.2 / true_speed * (1 + rand.uniform(-noise, noise))
        scale = learned(scale, used, 0.2 / used, observed)
        used = in_use(used, scale)
    return used


@pytest.mark.parametrize("true_speed", [0.2, 0.5, 2.0, 5.0])
def test_a_table_figure_off_by_up_to_five_times_is_learned_within_a_hundred_answers(
    true_speed: float,
) -> None:
    assert learn(true_speed, 100) == pytest.approx(true_speed, rel=HYSTERESIS - 1)


def test_noise_around_the_true_speed_does_not_move_the_scale_in_use() -> None:
    assert {learn(1.0, 500, noise=0.3, seed=s) for s in range(20)} == {1.0}


def test_one_outlier_moves_the_scale_at_most_one_bounded_step() -> None:
    assert learned(1.0, 1.0, 0.1, 100.0) == pytest.approx(1 / MAX_STEP)
    assert learned(1.0, 1.0, 0.1, 0.1 / 10) == pytest.approx(10**0.05)


def test_the_edges_own_overhead_teaches_nothing() -> None:
    assert learned(1.3, 1.0, MIN_S / 2, 0.5) == 1.3
    assert learned(1.3, 1.0, 0.5, MIN_S / 2) == 1.3


@given(
    st.floats(1 / MAX_SCALE, MAX_SCALE),
    st.floats(1 / MAX_SCALE, MAX_SCALE),
    st.floats(0.0, 1e4, allow_nan=False),
    st.floats(0.0, 1e4, allow_nan=False),
)
def test_the_scale_stays_within_its_bounds(
    scale: float, used: float, predicted: float, observed: float
) -> None:
    after = learned(scale, used, predicted, observed)
    assert 1 / MAX_SCALE <= after <= MAX_SCALE
    assert scale / MAX_STEP - 1e-12 <= after <= scale * MAX_STEP + 1e-12
