"""Adapters owned by tenants in the routing tables (schema 6): the compiler lists, for every
region, which tenants may use each private adapter; the contract refuses a table that would
carry them where an edge cannot enforce them."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import msgspec
import orjson
import pytest

from federation.routing.compiler import compile_region_table
from regions.tables.schema import (
    COLD_SCHEMA_VERSION,
    PRIVATE_ADAPTERS_SCHEMA_VERSION,
    TableError,
    decode_table,
)
from tests.unit.test_routing_compiler import SNAPSHOT


def compiled(snapshot: Any, region: str) -> dict[str, Any]:
    doc: dict[str, Any] = compile_region_table(snapshot, region=region, version=3, generated_at="x")
    return doc


def test_every_regions_table_lists_the_tenants_allowed_each_private_adapter() -> None:
    snapshot = replace(
        SNAPSHOT,
        private_adapters={"m-8b-sql": ("acme",), "qwen-fr": ("globex", "acme")},
        plans={},
    )
    for region in ("us-east", "eu-west"):
        doc = compiled(snapshot, region)
        table = decode_table(orjson.dumps(doc))
        assert table.schema_version == PRIVATE_ADAPTERS_SCHEMA_VERSION
        assert doc["private_adapters"] == {"m-8b-sql": ["acme"], "qwen-fr": ["globex", "acme"]}
        assert list(doc["private_adapters"]) == sorted(doc["private_adapters"])


def test_without_private_adapters_the_table_keeps_its_schema() -> None:
    doc = compiled(SNAPSHOT, "us-east")
    assert "private_adapters" not in doc
    assert decode_table(orjson.dumps(doc)).schema_version < PRIVATE_ADAPTERS_SCHEMA_VERSION


def base_doc(**extra: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "schema_version": PRIVATE_ADAPTERS_SCHEMA_VERSION,
        "version": 1,
        "region": "r1",
        "generated_at": "x",
        "tenants": [{"tenant": "acme", "key_hashes": []}],
        "private_adapters": {"a-lora": ["acme"]},
    }
    doc.update(extra)
    return doc


def test_the_contract_refuses_private_adapters_an_edge_could_not_enforce() -> None:
    assert decode_table(msgspec.json.encode(base_doc())).private_adapters == {"a-lora": ("acme",)}
    bad = {
        "an older schema": base_doc(schema_version=COLD_SCHEMA_VERSION),
        "no admission": base_doc(tenants=None),
        "no tenant": base_doc(private_adapters={"a-lora": []}),
        "an empty tenant": base_doc(private_adapters={"a-lora": [""]}),
        "an empty name": base_doc(private_adapters={"": ["acme"]}),
    }
    for why, doc in bad.items():
        with pytest.raises(TableError):
            decode_table(msgspec.json.encode(doc))
            pytest.fail(why)
