"""The fuzzer's own pieces: reach counting (tests/fuzz/reach.py), the NDJSON serializer and the
usage-record strategy (tests/fuzz/schemathesis_hooks.py), and the schema detail the fuzzer made
the API document (an empty choice filter)."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from hypothesis import find, given, settings
from rest_framework.test import APIClient

from regions.tables.usage import (
    POSITIONAL_FIELDS,
    USAGE_SCHEMA_VERSION,
    UsageRecordError,
    decode_record,
)
from tests.fuzz import reach
from tests.fuzz.schemathesis_hooks import (
    UsageSender,
    ndjson_lines,
    path_parameter_source,
    usage_records,
    values_of,
)

SENDER = UsageSender(
    edge="fuzz-eu-west", region="eu-west", instances=["i-0"], models=["m"], tenants=["acme"]
)
NOW = 1_796_000_000.0
SCHEMA: dict[str, Any] = {
    "paths": {
        "/api/v1/edges/": {"get": {}, "post": {}},
        "/api/v1/edges/{id}/": {"get": {}, "delete": {}},
        "/api/v1/edges/{name}/usage": {"post": {}},
        "/api/v1/edges/{region}/routing-table": {"get": {}},
    }
}


def test_an_operation_answered_only_401_or_404_is_unreached() -> None:
    ops = reach.operations(SCHEMA)
    result = reach.reach(
        ops,
        [
            ("GET", "http://h/api/v1/edges/?limit=1", 200),
            ("POST", "http://h/api/v1/edges/", 400),
            ("GET", "http://h/api/v1/edges/7/", 404),
            ("GET", "http://h/api/v1/edges/7/", 401),
            ("DELETE", "http://h/api/v1/edges/7/", 409),
            ("POST", "http://h/api/v1/edges/fuzz-eu/usage", 200),
            ("GET", "http://h/api/v1/edges/eu-west/routing-table", 500),
        ],
    )
    assert result.unreached() == ["GET /api/v1/edges/{id}/"]
    assert result.with_2xx() == ["GET /api/v1/edges/", "POST /api/v1/edges/{name}/usage"]
    assert result.server_errors() == ["GET /api/v1/edges/{region}/routing-table"]


def test_a_url_goes_to_its_most_literal_template() -> None:
    ops = reach.operations(SCHEMA)
    usage = reach.match(ops, "post", "http://h/api/v1/edges/usage/usage")
    assert usage is not None and usage.path == "/api/v1/edges/{name}/usage"
    assert reach.match(ops, "put", "http://h/api/v1/edges/1/") is None


def test_path_parameters_come_from_the_collection_listing_them() -> None:
    assert path_parameter_source("/api/v1/edges/{name}/usage") == ("/api/v1/edges/", "name")
    assert path_parameter_source("/api/v1/tenants/{slug}/") == ("/api/v1/tenants/", "slug")
    assert path_parameter_source("/api/v1/regions/") is None
    items: list[dict[str, Any]] = [
        {"id": 1, "region": "eu-west"},
        {"id": 2, "region": {"code": "us-east"}},
        {"id": 1},
    ]
    assert values_of(items, "id") == [1, 2]
    assert values_of(items, "region") == ["eu-west", "us-east"]


def test_ndjson_bodies_are_one_document_a_line() -> None:
    class Binary(str):
        data = b"[3]\n[3]"

    assert ndjson_lines(Binary()) == b"[3]\n[3]"
    assert ndjson_lines([{"a": 1}, [2]]) == b'{"a": 1}\n[2]'
    assert ndjson_lines(7) == b"7"
    assert ndjson_lines("x") == b"x"
    assert ndjson_lines(None) is None


@settings(max_examples=25, deadline=None)
@given(usage_records(SENDER, NOW))
def test_generated_usage_batches_are_schema_4_records(batch: bytes) -> None:
    """Each line is a record as an edge writes it (decoding may still refuse its values)."""
    for line in batch.split(b"\n"):
        row = msgspec.json.decode(line)
        assert row[0] == USAGE_SCHEMA_VERSION and len(row) == len(POSITIONAL_FIELDS) + 2


def test_most_generated_usage_records_are_valid() -> None:
    batches = usage_records(SENDER, NOW)
    valid = find(
        batches, lambda batch: len([ok for ok in map(decodes, batch.split(b"\n")) if ok]) >= 3
    )
    assert valid


def decodes(line: bytes) -> bool:
    try:
        decode_record(line)
    except UsageRecordError:
        return False
    return True


@pytest.mark.django_db
def test_an_empty_filter_value_is_documented_and_accepted(admin_client: APIClient) -> None:
    """django-filter reads ``?interconnect=`` as no filter; the schema said it was invalid."""
    schema = admin_client.get("/api/schema/?format=json").json()

    def parameter(path: str, name: str) -> dict[str, Any]:
        found: dict[str, Any] = next(
            p for p in schema["paths"][path]["get"]["parameters"] if p["name"] == name
        )
        return found["schema"]

    assert "" in parameter("/api/v1/pools/", "interconnect")["enum"]
    created_before = parameter("/api/v1/audit-events/", "created_before")
    assert {"type": "string", "maxLength": 0} in created_before["anyOf"]
    assert admin_client.get("/api/v1/pools/?interconnect=").status_code == 200
    assert admin_client.get("/api/v1/audit-events/?created_before=").status_code == 200


@pytest.mark.django_db
def test_a_single_value_filter_given_twice_is_refused(admin_client: APIClient) -> None:
    """django-filter used the last of ``?base_model=1&base_model=2``; lists stay lists."""
    r = admin_client.get("/api/v1/adapters/?base_model=1&base_model=2")
    assert r.status_code == 400, r.content
    assert "base_model" in r.json()
    assert admin_client.get("/api/v1/adapters/?base_model=1").status_code == 200
    assert admin_client.get("/api/v1/instances/?state=ready&state=failed").status_code == 200
