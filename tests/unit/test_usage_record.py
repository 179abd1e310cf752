"""The usage record's two wire forms: schema 2 (positional, what edges write) and schema 1 (named
fields, still read for records an older edge left behind)."""

from __future__ import annotations

import msgspec
import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from regions.tables.usage import (
    NAMED_SCHEMA_VERSION,
    POSITIONAL_FIELDS,
    USAGE_SCHEMA_VERSION,
    UsageRecord,
    UsageRecordError,
    decode_record,
    encode_named_record,
    encode_record,
)

text = st.text(min_size=1, max_size=20)
optional = st.none() | text
records = st.builds(
    UsageRecord,
    request_id=text,
    started_at=st.floats(0, 4e9),
    region=text,
    entry_region=text,
    instance=text,
    model=text,
    adapter=optional,
    tenant=optional,
    key_prefix=optional,
    prompt_tokens=st.integers(0, 10**6),
    cached_tokens=st.just(0),
    completion_tokens=st.integers(0, 10**6),
    ttft_ms=st.none() | st.floats(0, 1e6),
    duration_ms=st.floats(0, 1e7),
    status=st.integers(100, 599),
    streamed=st.booleans(),
    cancelled=st.booleans(),
    usage_reported=st.booleans(),
    edge=optional,
)


@given(records)
def test_a_record_survives_either_wire_form(record: UsageRecord) -> None:
    assert decode_record(encode_record(record)) == record
    named = decode_record(encode_named_record(record))
    assert named == msgspec.structs.replace(record, schema_version=NAMED_SCHEMA_VERSION)


def test_schema_2_is_the_version_then_every_field_in_order() -> None:
    record = UsageRecord(
        request_id="r-1",
        started_at=1.5,
        region="eu-west",
        entry_region="us-east",
        instance="eu-west/i-0",
        model="m",
        tenant="acme",
        key_prefix="fi_ab",
        prompt_tokens=10,
        cached_tokens=4,
        completion_tokens=3,
        ttft_ms=12.0,
        duration_ms=40.0,
        edge="edge-eu",
    )
    row = orjson.loads(encode_record(record))
    assert row[0] == USAGE_SCHEMA_VERSION == 2
    assert dict(zip(POSITIONAL_FIELDS, row[1:], strict=True)) == {
        f: getattr(record, f) for f in POSITIONAL_FIELDS
    }
    assert "schema_version" not in POSITIONAL_FIELDS
    assert len(encode_record(record)) < len(encode_named_record(record)) / 2


@pytest.mark.parametrize(
    ("document", "why"),
    [
        (b'[3,"r",1.0,"eu","eu","i","m",null,null,null,1,0,1,null,1.0,200,false,false,true,null]',
         "unsupported usage schema_version 3"),
        (b'[2,"r",1.0,"eu","eu","i","m",null,null,null,1,0,1,null,1.0,200,false,false,true]',
         "does not decode"),
        (b'[2,"r",1.0,"eu","eu","i","m",null,null,null,1,5,1,null,1.0,200,false,false,true,null]',
         "cached within the prompt"),
        (b'[2,"","1.0","eu","eu","i","m",null,null,null,1,0,1,null,1.0,200,false,false,true,null]',
         "does not decode"),
        (b'{"request_id":"r","started_at":1.0,"region":"eu","entry_region":"eu","instance":"i",'
         b'"model":"m","schema_version":2}', "named-field records are schema 1"),
        (b'{"request_id":"r","started_at":1.0,"region":"eu","entry_region":"eu","instance":"i",'
         b'"model":"m","schema_version":1,"surprise":1}', "does not decode"),
    ],
)  # fmt: skip
def test_a_defective_record_is_refused_with_its_reason(document: bytes, why: str) -> None:
    with pytest.raises(UsageRecordError, match=why):
        decode_record(document)
