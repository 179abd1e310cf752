"""The usage record's wire forms: schema 3 (positional, the id split in two: what edges write),
schema 2 (positional, the id whole) and schema 1 (named fields), both still read for records an
older edge left behind."""

from __future__ import annotations

import msgspec
import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from regions.tables.usage import (
    NAMED_SCHEMA_VERSION,
    POSITIONAL_FIELDS,
    SPLIT_ID_FIELDS,
    USAGE_SCHEMA_VERSION,
    WHOLE_ID_SCHEMA_VERSION,
    UsageRecord,
    UsageRecordError,
    decode_record,
    encode_named_record,
    encode_record,
    encode_usage_lines,
    encode_whole_id_record,
    request_id,
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
def test_a_record_survives_every_wire_form(record: UsageRecord) -> None:
    assert decode_record(encode_record(record)) == record
    whole = decode_record(encode_whole_id_record(record))
    assert whole == msgspec.structs.replace(record, schema_version=WHOLE_ID_SCHEMA_VERSION)
    named = decode_record(encode_named_record(record))
    assert named == msgspec.structs.replace(record, schema_version=NAMED_SCHEMA_VERSION)


def test_the_edge_writes_the_id_as_prefix_and_sequence_and_readers_join_them() -> None:
    fields = [1.5, "eu", "eu", "i", "m", None, None, None, 10, 4, 3, None, 40.0, 200]
    row = (USAGE_SCHEMA_VERSION, "3f9c2a1b7d0e-", 26, *fields, False, False, True, "edge-eu")
    [line] = encode_usage_lines([row]).splitlines()
    assert line.startswith(b'[3,"3f9c2a1b7d0e-",26,1.5,')
    record = decode_record(line)
    assert record.request_id == "3f9c2a1b7d0e-1a" == request_id("3f9c2a1b7d0e-", 26)
    # The same request written whole by a schema-2 edge is the same id: counted once.
    assert decode_record(encode_whole_id_record(record)).request_id == record.request_id
    assert SPLIT_ID_FIELDS == ("request_id_prefix", "request_id_seq")


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
    row = orjson.loads(encode_whole_id_record(record))
    assert row[0] == WHOLE_ID_SCHEMA_VERSION == 2
    assert dict(zip(POSITIONAL_FIELDS, row[1:], strict=True)) == {
        f: getattr(record, f) for f in POSITIONAL_FIELDS
    }
    assert "schema_version" not in POSITIONAL_FIELDS
    assert len(encode_whole_id_record(record)) < len(encode_named_record(record)) / 2
    split = orjson.loads(encode_record(record))
    assert split[:3] == [USAGE_SCHEMA_VERSION, "r-1", None] and split[3:] == row[2:]


@pytest.mark.parametrize(
    ("document", "why"),
    [
        (b'[4,"r",1,1.0,"eu","eu","i","m",null,null,null,1,0,1,null,1.0,200,false,false,true,null]',
         "unsupported usage schema_version 4"),
        (b'[30,"r",1.0,"eu","eu","i","m",null,null,null,1,0,1,null,1.0,200,false,false,true,null]',
         "unsupported usage schema_version 30"),
        (b'[3,"r",1.0,"eu","eu","i","m",null,null,null,1,0,1,null,1.0,200,false,false,true,null]',
         "does not decode"),
        (b'[3,"r","1","eu","eu","i","m",null,null,null,1,0,1,null,1.0,200,false,false,true,null,null]',
         "does not decode"),
        (b'[3,"",null,1.0,"eu","eu","i","m",null,null,null,1,0,1,null,1.0,200,false,false,true,null]',
         "must not be empty"),
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
