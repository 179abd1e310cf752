"""The pure half of P/D routing: when two hops, which decode instance, the legs' bodies."""

from __future__ import annotations

from typing import Any

import orjson

from regions.edge.config import DisaggConfig
from regions.edge.policy.scheduler import Candidate
from regions.edge.stages.disagg import (
    PREFILL_KV_PARAMS,
    decode_body,
    pick_decode,
    plan,
    prefill_body,
    response_params,
)

CFG = DisaggConfig(min_prompt_tokens=256)


def cand(
    id: str,
    role: str,
    *,
    model: str = "m",
    healthy: bool = True,
    state: str = "ready",
    inflight: int = 0,
    outstanding: int = 0,
    cap: int = 8,
    kv: float = 0.1,
) -> Candidate:
    return Candidate(
        id=id,
        model=model,
        adapters=("m-lora",),
        role=role,
        state=state,
        healthy=healthy,
        max_concurrency=cap,
        prefill_tokens_per_s=10_000.0,
        inflight=inflight,
        outstanding=outstanding,
        waiting=0,
        kv_usage=kv,
        pending_tokens=0.0,
        mean_uncached_tokens=256.0,
        mean_service_s=1.0,
    )


def test_plan_uses_two_hops_only_for_models_with_prefill_and_decode() -> None:
    pd = [cand("p", "prefill"), cand("d", "decode")]
    assert plan(pd, "m", 10, CFG) == "pd"
    assert plan(pd, "m-lora", 10, CFG) == "pd"  # adapters follow their base instances
    assert plan([cand("x", "mixed")], "m", 10_000, CFG) is None
    assert plan(pd, "other", 10, CFG) is None


def test_plan_sends_short_prompts_to_mixed_instances_when_there_are_some() -> None:
    three = [cand("p", "prefill"), cand("d", "decode"), cand("x", "mixed")]
    assert plan(three, "m", 255, CFG) is None
    assert plan(three, "m", 256, CFG) == "pd"


def test_plan_without_a_usable_prefill_instance() -> None:
    dead_p = cand("p", "prefill", healthy=False)
    assert plan([dead_p, cand("d", "decode"), cand("x", "mixed")], "m", 999, CFG) is None
    assert plan([dead_p, cand("d", "decode")], "m", 999, CFG) == "decode_only"
    draining = cand("p", "prefill", state="draining")
    assert plan([draining, cand("d", "decode")], "m", 999, CFG) == "decode_only"
    assert plan([dead_p, cand("d", "decode", healthy=False)], "m", 999, CFG) == "none"
    # A mixed instance exists but is down: the single-hop path explains the refusal.
    down = [dead_p, cand("d", "decode", healthy=False), cand("x", "mixed", healthy=False)]
    assert plan(down, "m", 999, CFG) is None


def test_pick_decode_takes_the_least_loaded_by_cap() -> None:
    cands = [
        cand("p", "prefill"),
        cand("d1", "decode", outstanding=4, cap=8),  # 0.5
        cand("d2", "decode", outstanding=4, cap=16),  # 0.25
        cand("d3", "decode", outstanding=1, cap=8, inflight=3),  # own in-flight wins: 0.375
    ]
    pick = pick_decode(cands, "m", frozenset(), 0, CFG)
    assert (pick.instance, pick.load, pick.runner_up) == ("d2", 0.25, "d3")
    assert pick_decode(cands, "m", frozenset({"d2"}), 0, CFG).instance == "d3"


def test_pick_decode_rotates_ties_and_respects_caps_and_kv() -> None:
    even = [cand("d1", "decode"), cand("d2", "decode")]
    assert {pick_decode(even, "m", frozenset(), t, CFG).instance for t in range(4)} == {
        "d1",
        "d2",
    }
    full = [cand("d1", "decode", inflight=8), cand("d2", "decode", kv=0.99, outstanding=5)]
    assert pick_decode(full, "m", frozenset(), 0, CFG).instance == "d2"  # KV full beats no slot
    kv = [cand("d1", "decode", kv=0.99), cand("d2", "decode", outstanding=6)]
    assert pick_decode(kv, "m", frozenset(), 0, CFG).instance == "d2"
    capped = [cand("d1", "decode", inflight=8)]
    assert pick_decode(capped, "m", frozenset(), 0, CFG).reason == "saturated"
    gone = [cand("d1", "decode", healthy=False), cand("p", "prefill")]
    none = pick_decode(gone, "m", frozenset(), 0, CFG)
    assert none.instance is None and none.reason == "no_healthy_instance"


def test_prefill_leg_body_is_vllms() -> None:
    client = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_completion_tokens": 300,
        "min_tokens": 5,
        "temperature": 0.2,
    }
    leg: dict[str, Any] = orjson.loads(prefill_body(orjson.dumps(client)))
    assert leg["kv_transfer_params"] == PREFILL_KV_PARAMS
    assert leg["stream"] is False and leg["max_tokens"] == 1
    assert leg["max_completion_tokens"] == 1
    assert "stream_options" not in leg and "min_tokens" not in leg
    assert leg["messages"] == client["messages"] and leg["temperature"] == 0.2
    assert "max_completion_tokens" not in orjson.loads(prefill_body(b'{"prompt": "x"}'))


def test_decode_leg_is_the_client_request_plus_the_params() -> None:
    params = {"do_remote_prefill": True, "remote_block_ids": [1, 2], "remote_port": 5}
    client = b'{"model":"m","prompt":"x","stream":true,"max_tokens":40}'
    leg = orjson.loads(decode_body(client, params))
    assert leg == {**orjson.loads(client), "kv_transfer_params": params}


def test_response_params() -> None:
    params = {"do_remote_prefill": True, "remote_engine_id": "e"}
    assert response_params(orjson.dumps({"id": "x", "kv_transfer_params": params})) == params
    assert response_params(b'{"kv_transfer_params": null}') is None
    assert response_params(b'{"kv_transfer_params": {}}') is None
    assert response_params(b"not json") is None
    assert response_params(b"[1]") is None
