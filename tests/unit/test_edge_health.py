"""Health hysteresis: N failures eject, M successes readmit after an exponential backoff."""

from __future__ import annotations

from regions.edge.view.health import (
    Health,
    HealthBoard,
    HealthConfig,
    on_connect_error,
    on_failure,
    on_success,
)

CFG = HealthConfig(eject_after=3, readmit_after=2, backoff_base_s=1.0, backoff_max_s=8.0)


def test_one_flap_does_not_eject() -> None:
    s = Health()
    s = on_failure(s, 0.0, CFG, "x")
    s = on_failure(s, 0.1, CFG, "x")
    assert s.healthy
    s = on_success(s, 0.2, CFG)
    assert s.healthy and s.probe_failures == 0
    s = on_failure(s, 0.3, CFG, "x")
    s = on_failure(s, 0.4, CFG, "x")
    assert s.healthy


def test_n_consecutive_failures_eject() -> None:
    s = Health()
    for t in range(3):
        s = on_failure(s, float(t), CFG, "probe status 500")
    assert not s.healthy
    assert s.reason == "probe status 500"
    assert s.ejected_until == 2.0 + 1.0


def test_readmission_needs_m_successes_and_the_backoff_to_end() -> None:
    s = on_connect_error(Health(), 10.0, CFG, "refused")
    assert not s.healthy and s.ejected_until == 11.0
    s = on_success(s, 10.2, CFG)
    s = on_success(s, 10.4, CFG)
    assert not s.healthy, "backoff not over yet"
    s = on_success(s, 11.1, CFG)
    assert s.healthy and s.reason == "readmitted"


def test_a_failure_during_probation_restarts_the_count() -> None:
    s = on_connect_error(Health(), 0.0, CFG, "refused")
    s = on_success(s, 2.0, CFG)
    s = on_failure(s, 2.1, CFG, "x")
    s = on_success(s, 2.2, CFG)
    assert not s.healthy
    s = on_success(s, 2.3, CFG)
    assert s.healthy


def test_backoff_doubles_per_ejection_up_to_the_cap_and_resets_after_a_quiet_period() -> None:
    s = Health()
    t = 0.0
    backoffs = []
    for _ in range(5):
        s = on_connect_error(s, t, CFG, "refused")
        backoffs.append(s.ejected_until - t)
        t = s.ejected_until
        s = on_success(on_success(s, t, CFG), t, CFG)
        assert s.healthy
    assert backoffs == [1.0, 2.0, 4.0, 8.0, 8.0]
    s = on_success(s, t + CFG.backoff_reset_s + 1, CFG)
    assert s.ejections == 0


def test_board_reports_ejections_once_and_tracks_table_changes() -> None:
    ejected: list[tuple[str, str]] = []
    board = HealthBoard(CFG, on_eject=lambda i, r: ejected.append((i, r)))
    board.sync(["a", "b"])
    board.connect_error("a", "refused")
    board.connect_error("a", "refused again")
    board.failure("unknown", "ignored")
    assert ejected == [("a", "refused")]
    assert not board.is_healthy("a") and board.is_healthy("b")
    board.sync(["b", "c"])
    assert set(board.states) == {"b", "c"} and board.is_healthy("c")


def test_a_readmitted_instance_is_on_probation_until_its_backoff_resets() -> None:
    s = on_connect_error(Health(), 0.0, CFG, "refused")
    s = on_success(on_success(s, 1.0, CFG), 1.0, CFG)
    assert s.healthy
    s = on_failure(s, 1.5, CFG, "status 500")
    assert not s.healthy and s.ejected_until == 1.5 + 2.0
    s = on_success(on_success(s, 4.0, CFG), 4.0, CFG)
    s = on_success(s, 4.0 + CFG.backoff_reset_s, CFG)
    assert s.healthy and s.ejections == 0
    s = on_failure(s, 70.0, CFG, "status 500")
    assert s.healthy, "after a quiet period one failure is a flap again"


def test_passing_probes_do_not_hide_failing_requests() -> None:
    s = on_failure(Health(), 0.0, CFG, "status 500", probe=False)
    s = on_success(s, 0.1, CFG, probe=True)
    s = on_failure(s, 0.2, CFG, "status 500", probe=False)
    assert s.healthy and s.request_failures == 2
    s = on_success(s, 0.3, CFG, probe=False)
    assert s.request_failures == 0
    for t in range(3):
        s = on_failure(s, 1.0 + t, CFG, "status 500", probe=False)
    assert not s.healthy and s.reason == "status 500"


def test_requests_do_not_readmit_an_ejected_instance() -> None:
    s = on_connect_error(Health(), 0.0, CFG, "refused")
    for _ in range(5):
        s = on_success(s, 5.0, CFG, probe=False)
    assert not s.healthy
    assert on_success(on_success(s, 5.0, CFG), 5.0, CFG).healthy
