"""Fault flags and the admin update: validation, parsing, deterministic decisions."""

from __future__ import annotations

import pytest

from regions.engines.simulator.faults import (
    FaultConfig,
    FaultInjector,
    apply_update,
    parse_fault_flag,
)


def test_flag_syntax() -> None:
    assert parse_fault_flag("error_rate=0.5,latency-ms=20") == (
        None,
        {"error_rate": 0.5, "latency_ms": 20},
    )
    assert parse_fault_flag("1:health_fail") == (1, {"health_fail": True})
    assert parse_fault_flag("die_after_tokens=none") == (None, {"die_after_tokens": None})
    for bad in ("", "error_rate", "latency_ms=fast"):
        with pytest.raises(ValueError):
            parse_fault_flag(bad)


def test_updates_are_validated() -> None:
    cfg = apply_update(FaultConfig(), {"error_rate": 1, "die_after_tokens": 3})
    assert (cfg.error_rate, cfg.die_after_tokens, cfg.active) == (1.0, 3, True)
    for bad in (
        {"error_rate": 1.5},
        {"latency_ms": -1},
        {"health_fail": "yes"},
        {"die_after_tokens": 1.5},
        {"explode": True},
    ):
        with pytest.raises(ValueError):
            apply_update(FaultConfig(), bad)


def test_fates_are_deterministic_and_follow_the_rates() -> None:
    config = FaultConfig(error_rate=0.3, hang_rate=0.1, die_after_tokens=2, die_rate=0.5)
    a = [FaultInjector(7, config).fate() for _ in range(1)]
    one, two = FaultInjector(7, config), FaultInjector(7, config)
    seq1 = [one.fate() for _ in range(2000)]
    seq2 = [two.fate() for _ in range(2000)]
    assert seq1 == seq2 and a[0] == seq1[0]
    assert 0.25 < sum(f.error for f in seq1) / 2000 < 0.35
    assert 0.07 < sum(f.hang for f in seq1) / 2000 < 0.13
    assert 0.45 < sum(f.die_after_tokens == 2 for f in seq1) / 2000 < 0.55
    other = [FaultInjector(8, config).fate() for _ in range(50)]
    assert other != seq1[:50]


def test_no_fault_means_no_draws_and_reset_clears() -> None:
    inj = FaultInjector(1)
    assert not inj.fate().error and inj.requests_seen == 0
    inj.update({"latency_ms": 5})
    assert inj.fate().latency_s == 0.005
    assert inj.reset() == FaultConfig()
