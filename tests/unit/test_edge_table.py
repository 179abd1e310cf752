"""Routing-table documents: strict decoding, validation, successor rules."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest

from regions.edge.control.table_file import read_table_file
from regions.tables.schema import (
    TableError,
    check_successor,
    decode_table,
    encode_table,
    served_models,
)


def doc(**kw: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "schema_version": 1,
        "version": 3,
        "region": "eu-west",
        "generated_at": "2026-11-29T09:00:00Z",
        "instances": [
            {
                "id": "i-1",
                "url": "http://127.0.0.1:9001",
                "model": "llama",
                "adapters": ["sql-lora"],
                "accelerator": "L4",
                "tp": 1,
                "max_concurrency": 32,
                "prefill_tokens_per_s": 6000,
            },
            {"id": "i-2", "url": "http://127.0.0.1:9002", "model": "qwen", "state": "stopped"},
        ],
        "remote_regions": [
            {
                "code": "us-east",
                "edge_url": "https://us-east.example",
                "rtt_ms": 80,
                "cost_per_mtok": 0.4,
            }
        ],
    }
    base.update(kw)
    return base


def enc(d: dict[str, Any]) -> bytes:
    return orjson.dumps(d)


def test_a_valid_document_decodes_with_defaults() -> None:
    t = decode_table(enc(doc()))
    assert t.version == 3 and t.region == "eu-west"
    i1, i2 = t.instances
    assert i1.adapters == ("sql-lora",) and i1.role == "mixed" and i1.state == "ready"
    assert i2.max_concurrency == 64 and i2.state == "stopped"
    assert t.remote_regions[0].rtt_ms == 80
    assert t.tenants is None and t.signature is None
    assert served_models(t) == ("llama", "sql-lora")


def test_reserved_issue_4_fields_decode() -> None:
    t = decode_table(
        enc(
            doc(
                tenants=[
                    {"tenant": "acme", "key_hashes": ["ab12"], "allowed_regions": ["eu-west"]}
                ],
                signature={"alg": "hmac-sha256", "key_id": "k1", "value": "00ff"},
            )
        )
    )
    assert t.tenants is not None and t.tenants[0].allowed_regions == ("eu-west",)
    assert t.signature is not None and t.signature.alg == "hmac-sha256"


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: d.update(schema_version=7), "schema_version"),
        (lambda d: d.update(cold_models=[{"model": "qwen"}]), "cold_models need schema_version"),
        (
            lambda d: d.update(schema_version=5, cold_models=[{"model": "llama"}]),
            "has an instance here",
        ),
        (
            lambda d: d.update(schema_version=5, cold_models=[{"model": "q"}, {"model": "q"}]),
            "listed twice",
        ),
        (
            lambda d: d.update(schema_version=5, cold_models=[{"model": "q", "cold_start_s": 0}]),
            "cold_start_s",
        ),
        (
            lambda d: d.update(
                schema_version=5, cold_models=[{"model": "q", "adapters": ["sql-lora"]}]
            ),
            "has an instance here",
        ),
        (lambda d: d["remote_regions"][0].update(edges=["http://b"]), "edges need schema_version"),
        (
            lambda d: (
                d.update(schema_version=4) or d["remote_regions"][0].update(edges=["ftp://b"])
            ),
            "edges 'ftp://b'",
        ),
        (
            lambda d: (
                d.update(schema_version=4)
                or d["remote_regions"][0].update(edges=[d["remote_regions"][0]["edge_url"]])
            ),
            "an edge is listed twice",
        ),
        (
            lambda d: (
                d.update(schema_version=4)
                or d["remote_regions"][0].update(edges=[f"http://e{i}" for i in range(16)])
            ),
            "at most 16 edges",
        ),
        (lambda d: d.update(ramp=0.5), "ramp needs schema_version 2"),
        (lambda d: d["remote_regions"][0].update(ramp=0.5), "us-east.ramp needs schema_version"),
        (lambda d: d.update(schema_version=2, ramp=1.5), "ramp must be within"),
        (lambda d: d.update(schema_version=2, ramp=-0.1), "ramp must be within"),
        (lambda d: d.update(version=0), "version"),
        (lambda d: d.update(surprise=1), "unknown field"),
        (lambda d: d["instances"][1].update(id="i-1"), "duplicate instance"),
        (lambda d: d["instances"][0].update(url="ftp://x"), "url"),
        (lambda d: d["instances"][0].update(role="leader"), "role"),
        (lambda d: d["instances"][0].update(max_concurrency=0), "max_concurrency"),
        (lambda d: d["instances"][0].update(prefill_tokens_per_s=0), "prefill_tokens_per_s"),
        (lambda d: d["instances"][0].pop("model"), "model"),
        (lambda d: d["remote_regions"][0].update(code="eu-west"), "remote region"),
        (lambda d: d["remote_regions"][0].update(rtt_ms=-1), "rtt_ms"),
    ],
)
def test_defects_are_refused(mutate: Any, message: str) -> None:
    d = doc()
    mutate(d)
    with pytest.raises(TableError, match=message):
        decode_table(enc(d))


@pytest.mark.parametrize(
    ("url", "defect"),
    [
        ("ftp://x:21", "scheme must be http or https"),
        ("127.0.0.1:9001", "scheme must be http or https"),
        ("http://", "no host"),
        ("http://:9001", "no host"),
        ("http://user:pw@x:9001", "userinfo"),
        ("http://x:9001/v1", "path"),
        ("http://x:9001//", "path"),
        ("http://x:9001?a=1", "query"),
        ("http://x:9001#f", "fragment"),
        ("http://x:99999", "port"),
        ("http://x:0", "port"),
        ("http://x:abc", "port"),
        ("http://[zz]:1", "does not parse"),
        ("http://x y:9001", "host"),
        ("http://h\u00f6st:9001", "host"),
    ],
)
def test_a_url_that_is_not_an_http_origin_is_refused_naming_its_owner(
    url: str, defect: str
) -> None:
    d = doc()
    d["instances"][0]["url"] = url
    with pytest.raises(TableError, match=rf"instance 'i-1': url .*{defect}"):
        decode_table(enc(d))
    d = doc()
    d["remote_regions"][0]["edge_url"] = url
    with pytest.raises(TableError, match=rf"remote region 'us-east': edge_url .*{defect}"):
        decode_table(enc(d))


@pytest.mark.parametrize(
    "url",
    [
        "http://vllm-0:8000",
        "http://vllm-0:8000/",
        "https://edge.eu-west.example",
        "http://[::1]:9001",
        "HTTP://X_1:80",
    ],
)
def test_http_and_https_origins_are_accepted(url: str) -> None:
    d = doc()
    d["instances"][0]["url"] = url
    d["remote_regions"][0]["edge_url"] = url
    t = decode_table(enc(d))
    assert t.instances[0].url == url and t.remote_regions[0].edge_url == url


def test_schema_2_carries_ramps_and_schema_1_defaults_them_to_full() -> None:
    assert decode_table(enc(doc())).ramp == 1.0
    d = doc(schema_version=2, ramp=0.4)
    d["remote_regions"][0]["ramp"] = 0.0
    t = decode_table(enc(d))
    assert t.ramp == 0.4 and t.remote_regions[0].ramp == 0.0


def test_garbage_is_refused() -> None:
    with pytest.raises(TableError, match="does not decode"):
        decode_table(b"{not json")


def test_successor_must_advance_and_match_the_region() -> None:
    cur = decode_table(enc(doc()))
    check_successor(None, cur, region="eu-west")
    check_successor(cur, decode_table(enc(doc(version=4))), region="eu-west")
    with pytest.raises(TableError, match="does not advance"):
        check_successor(cur, decode_table(enc(doc(version=3))), region="eu-west")
    with pytest.raises(TableError, match="region"):
        check_successor(cur, decode_table(enc(doc(version=9, region="us-east"))), region="eu-west")


def test_read_table_file(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    path.write_bytes(enc(doc()))
    assert read_table_file(path).version == 3
    with pytest.raises(TableError, match="cannot read"):
        read_table_file(tmp_path / "missing.json")


def test_cold_models_decode_at_schema_5_and_stay_out_of_older_documents() -> None:
    t = decode_table(
        enc(
            doc(
                schema_version=5,
                cold_models=[{"model": "mistral", "adapters": ["fr-lora"], "cold_start_s": 42.5}],
            )
        )
    )
    (cold,) = t.cold_models
    assert (cold.model, cold.adapters, cold.cold_start_s) == ("mistral", ("fr-lora",), 42.5)
    assert "cold_models" not in encode_table(decode_table(enc(doc())))
    assert encode_table(t)["cold_models"] == [
        {"model": "mistral", "adapters": ["fr-lora"], "cold_start_s": 42.5}
    ]
