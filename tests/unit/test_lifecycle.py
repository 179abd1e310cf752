"""Instance lifecycle: exactly the documented transitions are legal."""

from __future__ import annotations

import itertools

import pytest

from federation.core.errors import Conflict
from federation.inventory import lifecycle
from federation.inventory.models import Instance

LEGAL = {
    ("pending", "loading"),
    ("pending", "failed"),
    ("pending", "stopped"),
    ("loading", "warming"),
    ("loading", "failed"),
    ("loading", "stopped"),
    ("warming", "ready"),
    ("warming", "failed"),
    ("warming", "stopped"),
    ("ready", "draining"),
    ("ready", "failed"),
    ("ready", "stopped"),
    ("draining", "ready"),
    ("draining", "stopped"),
    ("draining", "failed"),
    ("stopped", "pending"),
    ("failed", "pending"),
    ("failed", "stopped"),
}


def test_states_match_the_model_choices() -> None:
    assert set(lifecycle.ORDER) == set(Instance.State.values)
    assert set(lifecycle.TRANSITIONS) == set(Instance.State.values)


@pytest.mark.parametrize(("source", "target"), sorted(itertools.product(lifecycle.ORDER, repeat=2)))
def test_exactly_the_documented_transitions_are_legal(source: str, target: str) -> None:
    legal = (source, target) in LEGAL
    assert lifecycle.is_legal(source, target) is legal
    if legal:
        lifecycle.check_transition(source, target)
    else:
        with pytest.raises(Conflict) as caught:
            lifecycle.check_transition(source, target)
        assert caught.value.code == "illegal_transition"


def test_conflict_message_lists_the_allowed_targets() -> None:
    with pytest.raises(Conflict) as caught:
        lifecycle.check_transition("stopped", "ready")
    assert str(caught.value) == (
        "An instance in state 'stopped' cannot move to 'ready'; allowed from 'stopped': pending."
    )
    assert lifecycle.allowed_targets("ready") == ["draining", "stopped", "failed"]


def test_unknown_states_are_refused() -> None:
    with pytest.raises(Conflict, match="Unknown target state 'serving'"):
        lifecycle.check_transition("ready", "serving")
    with pytest.raises(Conflict, match="Unknown instance state"):
        lifecycle.check_transition("zombie", "ready")


def test_live_and_terminal_states_partition_the_lifecycle() -> None:
    assert set(lifecycle.ORDER) == lifecycle.LIVE_STATES | lifecycle.TERMINAL_STATES
    assert not lifecycle.LIVE_STATES & lifecycle.TERMINAL_STATES
