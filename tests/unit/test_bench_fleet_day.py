"""The day replay's own mechanics, so its figures mean what docs/benchmarks.md says."""

from __future__ import annotations

from bench.fleet_day import Model, Region, Replica, peak_replicas, replay, static_scaler


def test_scaling_down_stops_idle_and_not_ready_replicas_at_once_and_drains_busy_ones() -> None:
    region = Region(Model())
    region.replicas = [
        Replica(started=0, ready_at=0, in_flight=3),
        Replica(started=0, ready_at=0, in_flight=0),
        Replica(started=50, ready_at=140),
    ]
    region.scale_to(2, 100.0)  # the one not ready yet goes first
    coming, idle, busy = region.replicas[2], region.replicas[1], region.replicas[0]
    assert coming.stopped == 100.0 and idle.stopped is None and idle.draining is False
    region.scale_to(0, 100.0)
    assert idle.stopped == 100.0 and busy.draining and busy.stopped is None
    # Scaling up again takes the warm draining replica back before starting a cold one.
    region.scale_to(2, 110.0)
    assert not busy.draining and len(region.replicas) == 4
    assert region.replicas[3].ready_at == 110.0 + region.model.cold_start_s
    assert region.gpu_seconds(200.0) == 200 + 100 + 50 + 90


def test_static_peak_costs_its_replicas_all_day_and_serves_within_the_target() -> None:
    model = Model(hours=0.25, peak_rps=6.0)
    region = replay(model, 0, static_scaler(peak_replicas(model)))
    assert region.requests > 1000
    assert region.gpu_seconds(model.hours * 3600) == peak_replicas(model) * model.hours * 3600
    assert region.within == region.requests


def test_too_few_replicas_show_up_as_waits_beyond_the_target() -> None:
    model = Model(hours=0.25, peak_rps=6.0)
    region = replay(model, 0, static_scaler(1))
    assert region.within < 0.5 * region.requests
    assert max(region.ttfts) > 60
