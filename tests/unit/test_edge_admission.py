"""Admission: key hash lookup, expiry, budget, residency refusals, token buckets. Pure."""

from __future__ import annotations

import hashlib
from typing import Any

import msgspec
import pytest

from regions.edge.http.errors import EdgeError
from regions.edge.policy.admission import Admission, TokenBucket
from regions.tables.schema import RoutingTable, TableError, decode_table


def h(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def table(tenants: list[dict[str, Any]] | None, **kw: Any) -> RoutingTable:
    doc: dict[str, Any] = {
        "schema_version": 1,
        "version": 1,
        "region": "eu-west",
        "generated_at": "2026-11-29T09:00:00Z",
        "tenants": tenants,
    }
    doc.update(kw)
    return decode_table(msgspec.json.encode(doc))


EU = {
    "tenant": "acme-eu",
    "key_hashes": [h("fi_eu"), h("fi_old")],
    "key_valid_until": {h("fi_old"): "2026-11-29T10:00:00Z"},
    "allowed_regions": ["eu-west"],
    "residency_class": "rc-eu",
    "requests_per_s": 2.0,
    "tokens_per_s": 100.0,
}
US = {"tenant": "us-only", "key_hashes": [h("fi_us")], "allowed_regions": ["us-east"]}
BROKE = {"tenant": "broke", "key_hashes": [h("fi_broke")], "budget_state": "exhausted",
         "allowed_regions": ["eu-west"]}  # fmt: skip
CLASSES = [{"id": "rc-eu", "allowed_regions": ["eu-west"], "refusals": {"qwen": "residency"}}]
EXPIRES = 1795946400.0  # 2026-11-29T10:00:00Z
T0 = EXPIRES - 86400.0


def adm(burst: float = 1.0) -> Admission:
    a = Admission("eu-west", burst_s=burst)
    a.load(table([EU, US, BROKE], residency_classes=CLASSES), now=0.0)
    return a


def code_of(fn: Any) -> tuple[int, str, int | None]:
    with pytest.raises(EdgeError) as info:
        fn()
    return info.value.status, info.value.code, info.value.retry_after


def test_no_tenants_section_disables_admission() -> None:
    a = Admission("eu-west")
    a.load(table(None), 0.0)
    assert not a.enabled
    a.load(table([]), 0.0)
    assert a.enabled and code_of(lambda: a.authenticate(b"Bearer fi_x", T0))[0] == 401


def test_authentication_by_key_hash() -> None:
    a = adm()
    assert a.authenticate(b"Bearer fi_eu", T0).slug == "acme-eu"
    assert a.authenticate(b"bearer  fi_eu ", T0).slug == "acme-eu"
    assert a.authenticate(b"Bearer fi_us", T0).local_allowed is False
    assert a.authenticate(b"Bearer fi_eu", T0).local_allowed is True
    for header in (None, b"", b"Bearer ", b"Basic Zm9v", b"fi_eu"):
        assert code_of(lambda header=header: a.authenticate(header, T0)) == (
            401, "invalid_api_key", None,
        )  # fmt: skip
    assert code_of(lambda: a.authenticate(b"Bearer fi_nope", T0))[1] == "invalid_api_key"


def test_expired_key_is_refused_even_while_the_table_still_lists_it() -> None:
    a = adm()
    expires = EXPIRES
    assert a.authenticate(b"Bearer fi_old", expires - 1).slug == "acme-eu"
    assert code_of(lambda: a.authenticate(b"Bearer fi_old", expires)) == (
        401, "api_key_expired", None,
    )  # fmt: skip
    assert a.authenticate(b"Bearer fi_eu", expires + 10**6).slug == "acme-eu"


def test_budget_and_residency_refusals() -> None:
    a = adm()
    broke = a.authenticate(b"Bearer fi_broke", T0)
    assert code_of(lambda: a.check(broke, "llama", 10, 0.0)) == (403, "budget_exhausted", None)
    eu = a.authenticate(b"Bearer fi_eu", T0)
    status, code, _ = code_of(lambda: a.check(eu, "qwen", 10, 0.0))
    assert (status, code) == (403, "model_not_allowed_here")
    a.check(eu, "llama", 10, 0.0)


def test_request_and_token_buckets_with_retry_after() -> None:
    a = adm(burst=1.0)  # 2 requests and 100 tokens of burst
    eu = a.authenticate(b"Bearer fi_eu", T0)
    a.check(eu, "llama", 10, 0.0)
    a.check(eu, "llama", 10, 0.0)
    assert code_of(lambda: a.check(eu, "llama", 10, 0.0)) == (429, "rate_limit_exceeded", 1)
    a.check(eu, "llama", 95, 0.5)  # one request refilled; tokens refilled to 100, 5 left
    # 0.6 s: 15 tokens, 0.2 requests -> 429; the longer wait (tokens: 0.75 s) is the answer.
    assert code_of(lambda: a.check(eu, "llama", 90, 0.6)) == (429, "rate_limit_exceeded", 1)
    # A refusal takes nothing: once both have refilled, the same request fits.
    a.check(eu, "llama", 90, 1.35)
    assert code_of(lambda: a.check(eu, "llama", 90, 1.36))[0] == 429
    # Unlimited tenant: never 429.
    us = a.authenticate(b"Bearer fi_us", T0)
    for _ in range(1000):
        a.check(us, "llama", 10**6, 0.0)


def test_settle_gives_back_what_the_request_did_not_use() -> None:
    a = adm(burst=1.0)  # 100 tokens of burst
    eu = a.authenticate(b"Bearer fi_eu", T0)
    a.check(eu, "llama", 90, 0.0)  # charged 90 up front (prompt + max_tokens)
    assert code_of(lambda: a.check(eu, "llama", 50, 0.0))[0] == 429
    a.settle(eu, charged=90, used=30)  # the answer was short: 60 back
    a.check(eu, "llama", 50, 0.0)
    # Usage above the charge is taken as debt, and the bucket never exceeds its capacity.
    a.settle(eu, charged=10, used=60)
    assert eu.tokens is not None and eu.tokens.level == pytest.approx(70 - 50 - 50)
    a.settle(eu, charged=10_000, used=0)
    assert eu.tokens.level == eu.tokens.capacity


def test_prompt_above_the_bucket_is_admitted_from_a_full_bucket_then_waits() -> None:
    b = TokenBucket(rate=10.0, capacity=10.0, now=0.0)
    assert b.wait_for(50, 0.0) == 0.0
    b.take(50)
    assert b.wait_for(1, 0.0) == pytest.approx(4.1)
    assert b.wait_for(1, 4.1) == pytest.approx(0.0)


def test_buckets_survive_a_new_table_and_follow_limit_changes() -> None:
    a = adm(burst=1.0)
    eu = a.authenticate(b"Bearer fi_eu", T0)
    a.check(eu, "llama", 0, 0.0)
    a.check(eu, "llama", 0, 0.0)
    a.load(table([{**EU, "requests_per_s": 4.0}, US]), now=0.0)
    eu2 = a.authenticate(b"Bearer fi_eu", T0)
    assert eu2.requests is eu.requests and eu2.requests is not None
    assert eu2.requests.rate == 4.0
    assert code_of(lambda: a.check(eu2, "llama", 0, 0.0))[0] == 429  # not refilled by the load
    a.check(eu2, "llama", 0, 0.25)
    assert code_of(lambda: a.authenticate(b"Bearer fi_broke", T0))[0] == 401  # dropped


def test_bad_key_valid_until_or_negative_limit_refuses_the_table() -> None:
    with pytest.raises(TableError, match="RFC 3339"):
        table([{**EU, "key_valid_until": {h("fi_old"): "tomorrow"}}])
    with pytest.raises(TableError, match="rate limits"):
        table([{**EU, "tokens_per_s": -1}])


def test_each_of_n_local_edges_enforces_its_share_of_a_rate_limit() -> None:
    def admitted(edges: int, requests: int) -> int:
        doc = table([EU], residency_classes=CLASSES)
        if edges > 1:
            doc = table([EU], residency_classes=CLASSES, schema_version=5, local_edges=edges)
        fleet = [Admission("eu-west", burst_s=2.0) for _ in range(edges)]
        for a in fleet:
            a.load(doc, now=0.0)
        ok = 0
        for n in range(requests):  # one request every 50 ms, each edge in turn, for 10 s
            a = fleet[n % edges]
            try:
                a.rate(a.by_hash[h("fi_eu")], 1, n * 0.05)
                ok += 1
            except EdgeError:
                pass
        return ok

    # 2 req/s and 2 s of burst: 10 s admit 2 x 10 + 4 = 24 at most, however many edges.
    single = admitted(1, 200)
    assert 20 <= single <= 24
    for edges in (2, 3):
        assert 20 <= admitted(edges, 200) <= 24 + edges  # + at most one each (bucket floor)


def test_local_edges_needs_schema_5_and_a_sane_count() -> None:
    with pytest.raises(TableError, match="schema_version 5"):
        table([EU], local_edges=2)
    with pytest.raises(TableError, match="local_edges"):
        table([EU], schema_version=5, local_edges=0)
