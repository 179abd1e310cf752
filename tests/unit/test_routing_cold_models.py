"""Cold models in the compiled tables: a deployment scaled to zero is known (schema 5), its
region's edges hold its requests instead of a 404; a model served here is never cold."""

from __future__ import annotations

from dataclasses import replace

import orjson

from federation.routing.compiler import compile_region_table
from federation.routing.snapshot import ColdRow
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


def test_a_registered_adapter_not_loaded_where_its_base_runs_is_cold_there() -> None:
    snapshot = replace(
        SNAPSHOT,
        loadable_adapters=(
            ("us-east", "m-8b-fr"),
            ("us-east", "m-8b-sql"),
            ("eu-west", "m-70b-legal"),
            ("ap-southeast", "m-8b-fr"),
        ),
        adapter_load_s=12.0,
    )
    _, us = table(snapshot, "us-east")  # us-1 serves m-8b with m-8b-sql loaded
    assert [(c.model, c.cold_start_s) for c in us.cold_models] == [("m-8b-fr", 12.0)]
    _, eu = table(snapshot, "eu-west")  # eu-1 serves m-70b
    assert [c.model for c in eu.cold_models] == ["m-70b-legal"]
    doc, _ = table(snapshot, "ap-southeast")  # evacuated: nothing cold
    assert "cold_models" not in doc
