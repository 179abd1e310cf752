"""The pure scheduler: filtering, expected-TTFT scoring, affinity hysteresis, policies."""

from __future__ import annotations

import dataclasses

import pytest

from regions.edge.scheduler import Candidate, RouteRequest, SchedulerConfig, decide, score

CFG = SchedulerConfig()
HARD_CAP = SchedulerConfig(wait_for_warm=False)


def cand(id: str, **kw: object) -> Candidate:
    base: dict[str, object] = dict(
        id=id,
        model="llama",
        adapters=("sql-lora",),
        role="mixed",
        state="ready",
        healthy=True,
        max_concurrency=8,
        prefill_tokens_per_s=10_000.0,
        inflight=0,
        outstanding=0,
        waiting=0,
        kv_usage=0.1,
        mean_uncached_tokens=500.0,
        mean_service_s=2.0,
        cached_blocks=0,
    )
    base.update(kw)
    return Candidate(**base)  # type: ignore[arg-type]


def req(**kw: object) -> RouteRequest:
    base: dict[str, object] = dict(model="llama", prompt_tokens=4000, block_tokens=16.0)
    base.update(kw)
    return RouteRequest(**base)  # type: ignore[arg-type]


def test_score_is_expected_ttft_in_seconds() -> None:
    idle = score(cand("a"), req(), CFG)
    assert idle.queue_s == 0.0
    # 4000 tokens at 10k tok/s, no decodes running: 0.4 s.
    assert idle.prefill_s == pytest.approx(0.4)
    cached = score(cand("a", cached_blocks=200), req(), CFG)
    assert cached.cached_tokens == 3200
    assert cached.prefill_s == pytest.approx(0.08)
    # Two requests waiting, each ~500 uncached tokens, half the batch decoding -> rate 6667/s.
    busy = score(cand("a", outstanding=4, waiting=2), req(), CFG)
    assert busy.queue_s == pytest.approx(2 * 500 / (10_000 / 1.5))
    assert busy.ttft_s == pytest.approx(busy.queue_s + 4000 / (10_000 / 1.5))


def test_a_full_prompt_is_never_entirely_cached() -> None:
    s = score(cand("a", cached_blocks=10_000), req(prompt_tokens=100), CFG)
    assert s.cached_tokens == 99


def test_full_kv_cache_counts_as_a_full_batch() -> None:
    free = score(cand("a", outstanding=2), req(), CFG)
    full = score(cand("a", outstanding=2, kv_usage=0.97), req(), CFG)
    assert full.queue_s > free.queue_s
    assert full.queue_s == pytest.approx(2.0 / 8)


def test_filter_by_model_adapter_role_state_health_and_cap() -> None:
    cands = [
        cand("other", model="qwen", adapters=()),
        cand("prefill", role="prefill"),
        cand("draining", state="draining"),
        cand("sick", healthy=False),
        cand("full", inflight=8),
        cand("ok", outstanding=3),
    ]
    d = decide(cands, req(), HARD_CAP)
    assert d.winner is not None and d.winner.instance == "ok"
    assert d.runner_up is None
    # Waiting for a slot is allowed by default, but "full" is no better, so it is only runner-up.
    d = decide(cands, req(), CFG)
    assert d.winner is not None and d.winner.instance == "ok" and not d.winner.wait
    assert d.runner_up is not None and d.runner_up.instance == "full" and d.runner_up.wait
    lora = decide(cands, req(model="sql-lora"), CFG)
    assert lora.winner is not None and lora.winner.instance == "ok"


def test_reasons_when_nothing_fits() -> None:
    assert decide([cand("a")], req(model="nope"), CFG).reason == "unknown_model"
    assert decide([cand("a", healthy=False)], req(), CFG).reason == "no_healthy_instance"
    full = [cand("a", inflight=8), cand("b", healthy=False)]
    saturated = decide(full, req(), HARD_CAP)
    assert saturated.winner is None and saturated.reason == "saturated"
    for policy in ("round_robin", "least_loaded"):
        cfg = dataclasses.replace(CFG, policy=policy)
        assert decide(full, req(), cfg).reason == "saturated"
    waits = decide(full, req(), CFG)
    assert waits.winner is not None and waits.winner.instance == "a" and waits.winner.wait
    excluded = decide([cand("a")], req(exclude=frozenset({"a"})), CFG)
    assert excluded.reason == "no_healthy_instance"


def test_prefix_holder_wins_over_idle_peer_when_the_cache_saves_more_than_its_queue() -> None:
    holder = cand("holder", cached_blocks=225, outstanding=3, waiting=1)
    idle = cand("idle")
    d = decide([idle, holder], req(), CFG)
    assert d.winner is not None and d.winner.instance == "holder"
    assert d.runner_up is not None and d.runner_up.instance == "idle"
    assert d.reason == "best_ttft"


def test_a_short_prompt_goes_to_the_less_loaded_instance_despite_a_cache_hit() -> None:
    holder = cand("holder", cached_blocks=3, outstanding=6, waiting=3)
    idle = cand("idle")
    d = decide([holder, idle], req(prompt_tokens=60), CFG)
    assert d.winner is not None and d.winner.instance == "idle"


def test_session_sticks_within_the_hysteresis_band() -> None:
    sticky = cand("sticky", outstanding=3)  # slower than idle but not by much
    idle = cand("idle")
    d = decide([idle, sticky], req(sticky="sticky"), CFG)
    assert d.winner is not None and d.winner.instance == "sticky"
    assert d.reason == "session"
    assert d.runner_up is not None and d.runner_up.instance == "idle"


def test_session_yields_only_to_real_overload() -> None:
    overloaded = cand("sticky", outstanding=8, waiting=6)
    idle = cand("idle")
    d = decide([idle, overloaded], req(sticky="sticky"), CFG)
    assert d.winner is not None and d.winner.instance == "idle"
    assert d.reason == "session_yield"
    assert d.runner_up is not None and d.runner_up.instance == "sticky"


def test_session_on_an_ejected_or_capped_instance_moves() -> None:
    for gone in (cand("sticky", healthy=False), cand("sticky", inflight=8)):
        d = decide([gone, cand("idle")], req(sticky="sticky"), CFG)
        assert d.winner is not None and d.winner.instance == "idle"


def test_ties_rotate_instead_of_always_hitting_the_same_instance() -> None:
    cands = [cand("a"), cand("b"), cand("c")]
    winners = {decide(cands, req(), CFG, turn=t).winner.instance for t in range(6)}  # type: ignore[union-attr]
    assert winners == {"a", "b", "c"}


def test_round_robin_and_least_loaded_policies() -> None:
    cands = [cand("a", outstanding=5), cand("b", outstanding=1), cand("c", outstanding=3)]
    rr = dataclasses.replace(CFG, policy="round_robin")
    seq = [decide(cands, req(), rr, turn=t).winner.instance for t in range(3)]  # type: ignore[union-attr]
    assert seq == ["a", "b", "c"]
    ll = dataclasses.replace(CFG, policy="least_loaded")
    for t in range(3):
        d = decide(cands, req(), ll, turn=t)
        assert d.winner is not None and d.winner.instance == "b"
        assert d.reason == "least_loaded"


def test_remote_rtt_is_part_of_the_same_seconds() -> None:
    far = cand("far", rtt_ms=80.0)
    near = cand("near", outstanding=2)
    d = decide([far, near], req(prompt_tokens=400), CFG)
    assert d.winner is not None and d.winner.instance == "near"


def test_waiting_for_a_warm_instance_beats_a_cold_prefill_until_its_line_grows() -> None:
    warm = cand("warm", inflight=8, outstanding=8, cached_blocks=240, mean_service_s=1.0)
    cold = cand("cold", outstanding=4)
    d = decide([cold, warm], req(), CFG)
    # Slot wait 1 s / 8 slots plus a 160-token prefill beats 4000 cold tokens.
    assert d.winner is not None and d.winner.instance == "warm" and d.winner.wait
    busy_line = dataclasses.replace(warm, queued=6)
    d = decide([cold, busy_line], req(), CFG)
    assert d.winner is not None and d.winner.instance == "cold" and not d.winner.wait


def test_a_stale_scrape_keeps_the_last_known_load_instead_of_reading_idle() -> None:
    from regions.edge.load import InstanceLoad
    from regions.engines.metrics import EngineLoad

    load = InstanceLoad()
    load.scraped(
        EngineLoad(num_requests_running=6, num_requests_waiting=2, kv_cache_usage_perc=0.5), 100.0
    )
    assert load.snapshot(100.2, stale_after_s=3.0) == (8, 2, 0.5)
    # Ten seconds without an answer to /metrics: still 8 outstanding, not 0.
    assert load.snapshot(110.0, stale_after_s=3.0) == (8, 2, 0.5)
    assert InstanceLoad().snapshot(110.0, stale_after_s=3.0) == (0, 0, 0.0)
