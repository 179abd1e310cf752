"""The pure scheduler: filtering, expected-TTFT scoring, affinity hysteresis, policies."""

from __future__ import annotations

import dataclasses

import pytest

from regions.edge.policy.scheduler import Candidate, RouteRequest, SchedulerConfig, decide, score
from regions.edge.policy.sessions import home

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
        pending_tokens=0.0,
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
    # One step costs as much as 128 prefill tokens: 12.8 ms at 10k tok/s on an idle engine.
    step = 128 / 10_000
    idle = score(cand("a"), req(), CFG)
    assert idle.queue_s == 0.0
    # 4000 tokens at 10k tok/s plus the one step that computes them.
    assert idle.prefill_s == pytest.approx(0.4 + step)
    cached = score(cand("a", cached_blocks=200), req(), CFG)
    assert cached.cached_tokens == 3200
    assert cached.prefill_s == pytest.approx(0.08 + step)
    # Half the batch decoding: steps 1.5x as long; the step in progress ends first (half a step
    # on average); two waiting requests of ~500 uncached tokens are computed first.
    busy = score(cand("a", outstanding=4, waiting=2), req(), CFG)
    assert busy.queue_s == pytest.approx(2 * 500 / 10_000 + 1.5 * step / 2)
    assert busy.ttft_s == pytest.approx(busy.queue_s + 0.4 + 1.5 * step)


def test_load_costs_time_per_step_not_per_prompt_token() -> None:
    """A full batch of decodes adds the same seconds to a cached and to a cold prompt; the old
    rate slowdown made a mostly cached prompt's load cost negligible (and a cold one's huge)."""
    for cached_blocks in (0, 240):
        idle = score(cand("a", cached_blocks=cached_blocks), req(), CFG)
        full = score(cand("a", cached_blocks=cached_blocks, outstanding=7), req(), CFG)
        step_full = 128 / 10_000 * (1 + 7 / 8)
        assert full.ttft_s - idle.ttft_s == pytest.approx(1.5 * step_full - 128 / 10_000)


def test_prefill_tokens_sent_and_not_yet_computed_are_queued_work() -> None:
    quiet = score(cand("a", outstanding=3), req(), CFG)
    sent = score(cand("a", outstanding=3, pending_tokens=6000.0), req(), CFG)
    assert sent.queue_s - quiet.queue_s == pytest.approx(0.6)
    # The engine's waiting queue is the same work seen from the engine: the larger view counts.
    both = score(cand("a", outstanding=3, pending_tokens=6000.0, waiting=2), req(), CFG)
    assert both.queue_s == pytest.approx(sent.queue_s)


def test_a_hot_prefix_spreads_before_its_holder_is_at_its_cap() -> None:
    """The holder has free seats, but the prefill it was just sent delays this request more
    than a cold prefill on an idle peer: the prefix is replicated now, not once seats run out."""
    holder = cand("holder", max_concurrency=16, outstanding=10, cached_blocks=237)
    idle = cand("idle", max_concurrency=16)
    d = decide([holder, idle], req(), CFG)
    assert d.winner is not None and d.winner.instance == "holder"
    backlogged = dataclasses.replace(holder, pending_tokens=5000.0)
    d = decide([backlogged, idle], req(), CFG)
    assert d.winner is not None and d.winner.instance == "idle"
    assert not d.winner.wait


def test_session_affinity_absorbs_a_burst_but_not_a_backlog_longer_than_moving() -> None:
    """Hysteresis and the backlog term do not fight: a session stays through a short burst of
    queued prefill (moving would recompute its whole history), and leaves a long one."""
    idle = cand("idle")
    burst = cand("sticky", outstanding=3, pending_tokens=5000.0, cached_blocks=240)
    d = decide([idle, burst], req(sticky="sticky"), CFG)
    assert d.winner is not None and d.winner.instance == "sticky"
    assert d.reason == "session"  # slower than the idle peer, inside the band
    backlog = dataclasses.replace(burst, pending_tokens=12_000.0)
    d = decide([idle, backlog], req(sticky="sticky"), CFG)
    assert d.winner is not None and d.winner.instance == "idle"
    assert d.reason == "session_yield"


def test_a_full_prompt_is_never_entirely_cached() -> None:
    s = score(cand("a", cached_blocks=10_000), req(prompt_tokens=100), CFG)
    assert s.cached_tokens == 99


def test_full_kv_cache_counts_as_a_full_batch() -> None:
    free = score(cand("a", outstanding=2), req(), CFG)
    full = score(cand("a", outstanding=2, kv_usage=0.97), req(), CFG)
    assert full.queue_s > free.queue_s
    # Half a (full-batch) step in progress, then one slot turnover: 2 s / 8 slots.
    assert full.queue_s == pytest.approx(128 / 10_000 + 2.0 / 8)


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
    # Its history cached, a line of prefill ahead: slower than the other but not by much.
    sticky = cand("sticky", outstanding=3, waiting=7, cached_blocks=200)
    other = cand("other", outstanding=3)
    r = req(sticky="sticky")
    assert score(other, r, CFG).ttft_s < score(sticky, r, CFG).ttft_s
    d = decide([other, sticky], r, CFG)
    assert d.winner is not None and d.winner.instance == "sticky"
    assert d.reason == "session"
    assert d.runner_up is not None and d.runner_up.instance == "other"


def test_leaving_a_session_counts_what_its_re_prefill_costs_the_streams_running_there() -> None:
    """Judged by the whole answer: a session that leaves its instance re-prefills its history
    elsewhere, and every stream decoding there waits while those tokens compute. A full
    instance with a long line is left for an idle one (nobody is slowed), not for one as soon
    for this request but running six streams (2.4 s of their time against 0.35 s saved)."""
    sticky = cand("sticky", outstanding=8, inflight=8, waiting=8, cached_blocks=200)
    r = req(sticky="sticky")
    idle, busy = cand("idle"), cand("busy", outstanding=6)
    assert score(busy, r, CFG).ttft_s < score(sticky, r, CFG).ttft_s / 1.5 - 0.05
    moved = decide([idle, sticky], r, CFG)
    assert moved.winner is not None and moved.winner.instance == "idle"
    assert moved.reason == "session_yield"
    kept = decide([busy, sticky], r, CFG)
    assert kept.winner is not None and kept.winner.instance == "sticky"
    assert kept.reason == "session"


def test_session_yields_only_to_real_overload() -> None:
    overloaded = cand("sticky", outstanding=8, waiting=6)
    idle = cand("idle")
    d = decide([idle, overloaded], req(sticky="sticky"), CFG)
    assert d.winner is not None and d.winner.instance == "idle"
    assert d.reason == "session_yield"
    assert d.runner_up is not None and d.runner_up.instance == "sticky"


def test_a_new_session_goes_to_its_home_at_every_edge_unless_overloaded() -> None:
    names = ["a", "b", "c", "d"]
    key = next(k for k in range(1000) if home(k, names) == "c")
    # Equal instances: without the session each decision rotates; with it, always its home.
    for turn in range(8):
        d = decide([cand(n) for n in names], req(session=key), CFG, turn=turn)
        assert d.winner is not None and d.winner.instance == "c" and d.reason == "session"
    # The home is overloaded: load still overrides it, as for a remembered instance.
    busy = [cand(n, outstanding=8, waiting=6) if n == "c" else cand(n) for n in names]
    d = decide(busy, req(session=key), CFG)
    assert d.winner is not None and d.winner.instance != "c" and d.reason == "session_yield"
    # A home only somewhat slower (within 1.5x, beyond the 50 ms margin) holds a remembered
    # session but not a new one: a first turn pays at most the margin for consistency.
    slower = [cand(n, outstanding=3, waiting=1) if n == "c" else cand(n) for n in names]
    # (Remembered, it holds the session's history: its own prefill is short.)
    held = [cand(n, outstanding=3, waiting=7, cached_blocks=200) if n == "c"
            else cand(n, outstanding=3) for n in names]  # fmt: skip
    assert decide(held, req(sticky="c"), CFG).winner.instance == "c"  # type: ignore[union-attr]
    d = decide(slower, req(session=key), CFG)
    assert d.winner is not None and d.winner.instance != "c"
    # An instance this edge remembers for the session comes first.
    d = decide([cand(n) for n in names], req(session=key, sticky="a"), CFG)
    assert d.winner is not None and d.winner.instance == "a"


def test_a_new_session_stays_off_a_hot_prefix_holder_far_busier_than_the_rest() -> None:
    """The skewed case: the holder of the hot system prompt has free seats, so this request
    alone would be sooner there; but a new session's later turns follow it, and the holder
    at 14 of 16 against 8 of 16 elsewhere is beyond the balance bound (load 0.875 > 0.5 +
    0.25, > 1.5 x 0.5 and > 0.75): the session goes to its home with a cold prefill instead."""
    names = ["a", "b", "c"]
    key = next(k for k in range(1000) if home(k, [*names, "holder"]) == "b")
    holder = cand("holder", max_concurrency=16, outstanding=14, cached_blocks=237)
    others = [cand(n, max_concurrency=16, outstanding=8) for n in names]
    cands = [holder, *others]
    d = decide(cands, req(session=key), CFG)
    assert d.winner is not None and d.winner.instance == "b" and d.reason == "session"
    assert score(holder, req(), CFG).ttft_s < d.winner.ttft_s - 0.3  # what the cache saves
    # Without a session nothing follows the request: the sooner holder takes it; a session
    # the edge placed there before stays (its history is cached there).
    d = decide(cands, req(), CFG)
    assert d.winner is not None and d.winner.instance == "holder"
    d = decide(cands, req(session=key, sticky="holder"), CFG)
    assert d.winner is not None and d.winner.instance == "holder" and d.reason == "session"
    # Within the bound (11 of 16: 0.69 <= 0.75) the cache still wins the new session.
    closer = dataclasses.replace(holder, outstanding=11)
    d = decide([closer, *others], req(session=key), CFG)
    assert d.winner is not None and d.winner.instance == "holder"
    assert d.reason == "session_yield"
    # A home beyond the bound is left like an overloaded one.
    busy_home = [holder, *(cand(n, max_concurrency=16, outstanding=14 if n == "b" else 4)
                           for n in names)]  # fmt: skip
    d = decide(busy_home, req(session=key), CFG)
    assert d.winner is not None and d.winner.instance in {"a", "c"}
    assert d.reason == "session_yield"
    # With seats to spare (12 of 16 against idle peers) there is nothing to bound: the cache
    # holder takes the new session.
    spare = [dataclasses.replace(holder, outstanding=12), *(cand(n, max_concurrency=16)
                                                          for n in names)]  # fmt: skip
    d = decide(spare, req(session=key), CFG)
    assert d.winner is not None and d.winner.instance == "holder"


def test_a_new_session_leaves_the_bound_when_the_line_in_bound_is_longer_than_a_first_token() -> (
    None
):
    """The skewed case's bad runs: a burst of new sessions all went to the least loaded
    instance (the only one in bound) and queued cold prefills there while the prompt's holders,
    beyond the bound, would have answered sooner. When the wait in the bounded line alone is
    longer than the whole expected TTFT elsewhere, the session leaves the bound."""
    names = ["a", "b", "c"]
    key = next(k for k in range(1000) if home(k, [*names, "holder"]) == "b")
    holder = cand("holder", max_concurrency=16, outstanding=13, cached_blocks=237)
    full = [cand(n, max_concurrency=16, outstanding=13) for n in ("a", "c")]
    # b: 4 of 16 seats, but 6,000 prefill tokens already sent to it (0.6 s at 10k tok/s).
    lined = cand("b", max_concurrency=16, outstanding=4, pending_tokens=6000.0)
    d = decide([holder, *full, lined], req(session=key), CFG)
    assert d.winner is not None and d.winner.instance == "holder"
    assert d.reason == "balance_escape" and d.runner_up is not None
    in_bound = score(lined, req(), CFG)
    assert d.winner.ttft_s < in_bound.queue_s
    # Equivalently: in bound it would be slower by more than its own cold prefill.
    assert in_bound.ttft_s - d.winner.ttft_s > in_bound.prefill_s
    # A short line (300 tokens: 30 ms, under the holder's 56 ms first token): the bound
    # holds, the home takes it cold.
    short = dataclasses.replace(lined, pending_tokens=300.0)
    d = decide([holder, *full, short], req(session=key), CFG)
    assert d.winner is not None and d.winner.instance == "b" and d.reason == "session"


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
    from regions.edge.view.load import InstanceLoad
    from regions.engines.metrics import EngineLoad

    load = InstanceLoad()
    load.scraped(
        EngineLoad(num_requests_running=6, num_requests_waiting=2, kv_cache_usage_perc=0.5), 100.0
    )
    assert load.snapshot() == (8, 2, 0.5)
    # However long without an answer to /metrics: still 8 outstanding, not 0.
    assert load.snapshot() == (8, 2, 0.5)
    assert InstanceLoad().snapshot() == (0, 0, 0.0)


def test_an_old_scrape_forgets_what_this_edge_saw_finish_since() -> None:
    """A reading taken while this edge's own request ran there must not keep the engine
    loaded after that request finished, however long the next reading takes."""
    from regions.edge.view.load import InstanceLoad
    from regions.engines.metrics import EngineLoad

    load = InstanceLoad()
    load.admit(10)
    load.scraped(EngineLoad(num_requests_running=1, num_requests_waiting=0), 100.0)
    assert load.snapshot() == (1, 0, 0.0)
    load.finish(0.5)
    assert load.snapshot() == (0, 0, 0.0)


def test_pending_prefill_drains_at_the_engine_rate_and_clears_when_idle() -> None:
    from regions.edge.view.load import InstanceLoad

    load = InstanceLoad()
    assert load.pending(10.0, 2000.0) == 0.0
    load.admit(1500)
    load.admit(500)
    assert load.pending(10.5, 2000.0) == pytest.approx(1000.0)
    assert load.pending(11.5, 2000.0) == 0.0
    load.admit(800)
    load.finish(1.0)
    assert load.pending(11.5, 2000.0) == pytest.approx(800.0)  # two still in flight
    load.finish(1.0)
    load.finish(1.0)
    assert load.pending(11.5, 2000.0) == 0.0  # all finished, so all were prefilled


def test_requests_sent_since_the_scrape_are_pending_tokens_not_waiting_requests() -> None:
    from regions.edge.view.load import InstanceLoad
    from regions.engines.metrics import EngineLoad

    load = InstanceLoad()
    load.scraped(EngineLoad(num_requests_running=2, num_requests_waiting=1), 100.0)
    load.pending(100.0, 1000.0)
    load.admit(300)
    load.admit(300)
    assert load.snapshot() == (5, 1, 0.0)
    assert load.pending(100.1, 1000.0) == pytest.approx(500.0)
