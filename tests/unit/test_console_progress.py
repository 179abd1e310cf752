"""The progress of long operations, from the figures the control plane keeps (pure)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from console.progress import Timeouts, fresh_in_flight, instance_progress, ramp_progress
from federation.routing.ramp import ramp_level
from federation.routing.snapshot import RampPolicy

NOW = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
TIMEOUTS = Timeouts(loading_s=600, warming_s=300, drain_s=60)


def ago(seconds: float) -> datetime:
    return NOW - timedelta(seconds=seconds)


def test_in_flight_counts_only_while_the_report_is_fresh() -> None:
    assert fresh_in_flight({"in_flight": 4, "reported_at": ago(5).isoformat()}, NOW) == 4
    assert fresh_in_flight({"in_flight": 4, "reported_at": ago(61).isoformat()}, NOW) is None
    assert fresh_in_flight({"in_flight": 4}, NOW) is None
    assert fresh_in_flight({"in_flight": -1, "reported_at": ago(1).isoformat()}, NOW) is None
    assert fresh_in_flight({"in_flight": True, "reported_at": ago(1).isoformat()}, NOW) is None
    assert fresh_in_flight(None, NOW) is None


@pytest.mark.parametrize(
    ("state", "elapsed", "limit"), [("loading", 90, 600), ("warming", 330, 300)]
)
def test_loading_and_warming_run_against_their_timeouts(
    state: str, elapsed: float, limit: float
) -> None:
    p = instance_progress(
        state=state, since=ago(elapsed), drain_reason="", in_flight=None, now=NOW, timeouts=TIMEOUTS
    )
    assert p is not None and p.maximum == limit
    assert p.value == min(elapsed, limit)  # past its timeout the bar stays full
    assert p.share == min(1.0, elapsed / limit)
    assert p.text.startswith(f"{state} for ")


def test_an_operator_drain_counts_the_requests_left() -> None:
    def drain(in_flight: int | None) -> str:
        p = instance_progress(
            state="draining",
            since=ago(10),
            drain_reason="operator",
            in_flight=in_flight,
            now=NOW,
            timeouts=TIMEOUTS,
        )
        assert p is not None
        assert (p.share == 1.0) == (in_flight == 0)  # no bar until it is done: no known end
        return p.text

    assert drain(5) == "5 requests in flight to finish"
    assert drain(1) == "1 request in flight to finish"
    assert drain(0) == "drained: nothing in flight"
    assert drain(None) == "requests in flight unknown (no fresh heartbeat)"


def test_a_scale_down_drain_runs_against_the_drain_timeout() -> None:
    p = instance_progress(
        state="draining",
        since=ago(45),
        drain_reason="scale_down",
        in_flight=2,
        now=NOW,
        timeouts=TIMEOUTS,
    )
    assert p is not None and (p.value, p.maximum) == (45, 60)
    assert (
        p.text
        == "2 requests in flight to finish; stopped when idle, or after 1 min 00 s (45 s so far)"
    )


@pytest.mark.parametrize("state", ["ready", "pending", "stopped", "failed"])
def test_other_states_have_no_progress(state: str) -> None:
    assert (
        instance_progress(
            state=state, since=ago(5), drain_reason="", in_flight=3, now=NOW, timeouts=TIMEOUTS
        )
        is None
    )


def test_a_ramp_follows_the_compilers_steps() -> None:
    policy = RampPolicy(window_s=120, steps=4)
    seen = []
    for elapsed in (0, 29, 30, 65, 119):
        p = ramp_progress(
            status="active", restored_at=ago(elapsed), recovered_at=None, now=NOW, policy=policy
        )
        assert p is not None and (p.value, p.maximum) == (elapsed, 120)
        assert f"{ramp_level(elapsed, policy) * 100:.0f} % of its traffic" in p.text
        seen.append(p.text.split(", next")[0])
    assert seen == [
        "ramping back: 20 % of its traffic, step 1 of 4",
        "ramping back: 20 % of its traffic, step 1 of 4",
        "ramping back: 40 % of its traffic, step 2 of 4",
        "ramping back: 60 % of its traffic, step 3 of 4",
        "ramping back: 80 % of its traffic, step 4 of 4",
    ]
    # From the later of restore and recovery; none once done, evacuated or never restored.
    later = ramp_progress(
        status="active", restored_at=ago(500), recovered_at=ago(10), now=NOW, policy=policy
    )
    assert later is not None and later.value == 10
    for status, restored in (("active", ago(120)), ("evacuated", ago(5)), ("active", None)):
        none = ramp_progress(
            status=status, restored_at=restored, recovered_at=None, now=NOW, policy=policy
        )
        assert none is None
