"""x-fedinfer-route: what each kind of answer says about the path it took (route.py)."""

from __future__ import annotations

from regions.edge.policy.route import (
    pd_route,
    prefill_refusal_route,
    remote_route,
    route_header,
    spill_failed_route,
)
from regions.edge.policy.scheduler import Decision, Scored
from regions.edge.stages.disagg import DecodePick


def test_route_header_names_winner_terms_runner_up_and_retries() -> None:
    w = Scored("i-3", 0.0121, 0.003, 0.0091, 512, 4)
    r = Scored("i-1", 0.0402, 0.0, 0.0402, 0, 0)
    text = route_header("us-east", Decision(w, r, "best_ttft"), 1).decode()
    assert text == (
        "region=us-east;instance=i-3;policy_reason=best_ttft;"
        "score=ttft_ms:12.1,queue_ms:3.0,prefill_ms:9.1,cached:512,load:4;"
        "runner_up=i-1:40.2;retries=1"
    )
    scored = Scored("i-3", 0.0521, 0.043, 0.0091, 512, 16, True, 0.0352, ahead_s=0.0028,
                    rate=13_881.4)  # fmt: skip
    text = route_header("us-east", Decision(scored, None, "session"), 0).decode()
    assert text == (
        "region=us-east;instance=i-3;policy_reason=session;"
        "score=ttft_ms:52.1,queue_ms:43.0,prefill_ms:9.1,cached:512,load:16,"
        "ahead_ms:2.8,slot_ms:35.2,rate:13881;retries=0"
    )
    refused = route_header("us-east", None, 0, "saturated").decode()
    assert refused == "region=us-east;instance=none;reason=saturated;retries=0"


def test_pd_route_shows_both_hops() -> None:
    prefill = Scored("p-1", 0.0125, 0.002, 0.0105, 640, 3)
    pick = DecodePick("d-2", 0.125, 2, "d-1", "least_decode_load")
    text = pd_route("eu", "pd", prefill, "", pick, "transferred", 0).decode()
    parts = dict(p.split("=", 1) for p in text.split(";"))
    assert parts["mode"] == "pd" and parts["prefill"] == "p-1" and parts["decode"] == "d-2"
    assert parts["score"].startswith("ttft_ms:12.5,") and "cached:640" in parts["score"]
    assert parts["decode_load"] == "0.125" and parts["decode_runner_up"] == "d-1"
    assert parts["kv"] == "transferred" and parts["retries"] == "0"
    failed = pd_route("eu", "pd", None, "p-1:status 500", pick, "none", 1).decode()
    assert "prefill=none;prefill_failed=p-1:status 500;decode=d-2" in failed


def test_a_spilled_answer_keeps_the_remote_header_and_says_where_it_came_from() -> None:
    theirs = b"region=eu-west;instance=i-2;policy_reason=best_ttft;retries=0"
    text = remote_route(theirs, "us-east", "eu-west", "ttft", 0.0824).decode()
    assert text == (
        "region=eu-west;remote_from=us-east;spill=ttft;rtt_ms=82;"
        "instance=i-2;policy_reason=best_ttft;retries=0"
    )
    # A remote edge that sent no header still names the region that answered.
    bare = remote_route(b"", "us-east", "eu-west", "not_local", 0.03).decode()
    assert bare == "region=eu-west;remote_from=us-east;spill=not_local;rtt_ms=30"


def test_refusals_without_a_local_instance_say_why() -> None:
    assert spill_failed_route("us-east", "residency") == (
        b"region=us-east;instance=none;reason=spill_failed;spill=residency"
    )
    assert prefill_refusal_route("eu", "p-1", 400) == (
        b"region=eu;mode=pd;prefill=p-1;decode=none;status=400"
    )
