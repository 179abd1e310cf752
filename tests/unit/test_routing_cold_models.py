"""Cold models in the compiled tables: a deployment scaled to zero is known (schema 5), its
region's edges hold its requests instead of a 404; a model served here is never cold."""

from __future__ import annotations

from dataclasses import replace

import orjson

from federation.routing.compiler import ColdRow, compile_region_table
from regions.tables.schema import COLD_SCHEMA_VERSION, decode_table
from tests.unit.test_routing_compiler import SNAPSHOT


def table(snapshot, region: str):  # type: ignore[no-untyped-def]
    doc = compile_region_table(snapshot, region=region, version=3, generated_at="x")
    return doc, decode_table(orjson.dumps(doc))


def test_a_deployment_at_zero_is_a_cold_model_of_its_region_only() -> None:
    snapshot = replace(
        SNAPSHOT,
        cold=(
            ColdRow("eu-west", "qwen-7b", ("qwen-fr", "qwen-de"), cold_start_s=42.04),
            ColdRow("eu-west", "qwen-7b", (), cold_start_s=30.0),  # a second pool: the faster
        ),
    )
    doc, eu = table(snapshot, "eu-west")
    assert eu.schema_version == COLD_SCHEMA_VERSION
    (cold,) = eu.cold_models
    assert (cold.model, cold.adapters, cold.cold_start_s) == (
        "qwen-7b",
        ("qwen-de", "qwen-fr"),
        30.0,
    )
    assert doc["cold_models"] == [
        {"model": "qwen-7b", "adapters": ["qwen-de", "qwen-fr"], "cold_start_s": 30.0}
    ]
    doc, us = table(snapshot, "us-east")
    assert "cold_models" not in doc and us.schema_version == 1


def test_a_model_served_here_by_another_deployment_is_not_cold() -> None:
    snapshot = replace(
        SNAPSHOT,
        cold=(
            ColdRow("us-east", "m-8b", ("m-8b-sql", "m-8b-new"), cold_start_s=60.0),
            ColdRow("eu-west", "m-70b", (), cold_start_s=60.0),
        ),
    )
    _, us = table(snapshot, "us-east")
    assert us.cold_models == ()
    _, eu = table(snapshot, "eu-west")
    assert eu.cold_models == ()


def test_an_evacuated_region_lists_no_cold_model() -> None:
    snapshot = replace(SNAPSHOT, cold=(ColdRow("ap-southeast", "qwen-7b"),))
    doc, _ = table(snapshot, "ap-southeast")
    assert "cold_models" not in doc
