"""The usage record's wire forms: schema 4 (positional, the id split in two, ending with the
continuation fields: what edges write), schema 3 (the same without them), schema 2 (positional,
the id whole) and schema 1 (named fields), all still read for records an older edge left behind;
and the continuation fields' checks."""

from __future__ import annotations

import msgspec
import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from regions.tables.usage import (
    CONTINUATION_FIELDS,
    LEGACY_POSITIONAL_FIELDS,
    NAMED_SCHEMA_VERSION,
    POSITIONAL_FIELDS,
    SPLIT_ID_FIELDS,
    SPLIT_ID_SCHEMA_VERSION,
    USAGE_SCHEMA_VERSION,
    WHOLE_ID_SCHEMA_VERSION,
    UsageRecord,
    UsageRecordError,
    decode_record,
    encode_named_record,
    encode_record,
    encode_split_id_record,
    encode_usage_lines,
    encode_whole_id_record,
    request_id,
)

text = st.text(min_size=1, max_size=20)
optional = st.none() | text
leg = st.from_regex(r"[a-z]{1,6}/[a-z0-9-]{1,8}", fullmatch=True)
#: The continuation fields, consistent: none, or 1..3 continuations with their legs.
continuations = st.just({}) | st.integers(1, 3).flatmap(
    lambda n: st.fixed_dictionaries(
        {
            "continued": st.just(n),
            "legs": st.lists(leg, min_size=n + 1, max_size=n + 1).map(",".join),
            "continuation_reason": st.none() | st.sampled_from(["engine_lost", "drain"]),
            "reprefill_tokens": st.integers(0, 10**6),
        }
    )
)
base_records = st.builds(
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
records = st.tuples(base_records, continuations).map(
    lambda pair: msgspec.structs.replace(pair[0], **pair[1])
)
NOT_CONTINUED = {"continued": 0, "legs": None, "continuation_reason": None, "reprefill_tokens": 0}


@given(records)
def test_a_record_survives_every_wire_form(record: UsageRecord) -> None:
    assert decode_record(encode_record(record)) == record
    named = decode_record(encode_named_record(record))
    assert named == msgspec.structs.replace(record, schema_version=NAMED_SCHEMA_VERSION)
    # Schemas 3 and 2 have no continuation fields: read as served by one engine.
    for encode, version in (
        (encode_split_id_record, SPLIT_ID_SCHEMA_VERSION),
        (encode_whole_id_record, WHOLE_ID_SCHEMA_VERSION),
    ):
        older = decode_record(encode(record))
        assert older == msgspec.structs.replace(record, schema_version=version, **NOT_CONTINUED)


def test_the_edge_writes_the_id_as_prefix_and_sequence_and_readers_join_them() -> None:
    fields = [1.5, "eu", "eu", "i", "m", None, None, None, 10, 4, 3, None, 40.0, 200]
    continued = (1, "eu/i-0,eu/i", "engine_lost", 17)
    row = (
        USAGE_SCHEMA_VERSION, "3f9c2a1b7d0e-", 26, *fields, False, False, True, "edge-eu",
        *continued,
    )  # fmt: skip
    [line] = encode_usage_lines([row]).splitlines()
    assert line.startswith(b'[4,"3f9c2a1b7d0e-",26,1.5,')
    assert line.endswith(b'"edge-eu",1,"eu/i-0,eu/i","engine_lost",17]')
    record = decode_record(line)
    assert record.request_id == "3f9c2a1b7d0e-1a" == request_id("3f9c2a1b7d0e-", 26)
    assert (record.continued, record.legs, record.continuation_reason) == continued[:3]
    assert (record.prompt_tokens, record.completion_tokens, record.reprefill_tokens) == (10, 3, 17)
    # The same request written whole by a schema-2 edge is the same id: counted once.
    assert decode_record(encode_whole_id_record(record)).request_id == record.request_id
    assert SPLIT_ID_FIELDS == ("request_id_prefix", "request_id_seq")


def test_a_schema_3_row_left_in_a_spool_still_decodes_as_served_by_one_engine() -> None:
    """What an edge wrote before the upgrade: the row without the four continuation values."""
    line = (
        b'[3,"3f9c2a1b7d0e-",26,1.5,"eu","eu","i","m",null,"acme","fi_ab",10,4,3,12.0,40.0,'
        b'200,true,false,true,"edge-eu"]'
    )
    record = decode_record(line)
    assert record.schema_version == SPLIT_ID_SCHEMA_VERSION == 3
    assert (record.request_id, record.tenant, record.edge) == ("3f9c2a1b7d0e-1a", "acme", "edge-eu")
    assert (record.prompt_tokens, record.cached_tokens, record.completion_tokens) == (10, 4, 3)
    assert {f: getattr(record, f) for f in CONTINUATION_FIELDS} == NOT_CONTINUED
    assert encode_split_id_record(record) == line.replace(
        b'"3f9c2a1b7d0e-",26', b'"3f9c2a1b7d0e-1a",null'
    )
    assert (*LEGACY_POSITIONAL_FIELDS, *CONTINUATION_FIELDS) == POSITIONAL_FIELDS
    assert LEGACY_POSITIONAL_FIELDS[-1] == "edge"


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
    assert dict(zip(LEGACY_POSITIONAL_FIELDS, row[1:], strict=True)) == {
        f: getattr(record, f) for f in LEGACY_POSITIONAL_FIELDS
    }
    assert "schema_version" not in POSITIONAL_FIELDS
    assert len(encode_whole_id_record(record)) < len(encode_named_record(record)) / 2
    split = orjson.loads(encode_record(record))
    assert split[:3] == [USAGE_SCHEMA_VERSION, "r-1", None] and split[3:-4] == row[2:]
    assert split[-4:] == [0, None, None, 0]  # served by one engine


@pytest.mark.parametrize(
    ("document", "why"),
    [
        (b'[5,"r",1,1.0,"eu","eu","i","m",null,null,null,1,0,1,null,1.0,200,false,false,true,null,0,null,null,0]',
         "unsupported usage schema_version 5"),
        # Schema 4 ends with the four continuation values; schema 3 does not.
        (b'[4,"r",1,1.0,"eu","eu","i","m",null,null,null,1,0,1,null,1.0,200,false,false,true,null]',
         "does not decode"),
        (b'[3,"r",1,1.0,"eu","eu","i","m",null,null,null,1,0,1,null,1.0,200,false,false,true,null,0,null,null,0]',
         "does not decode"),
        (b'[4,"r",1,1.0,"eu","eu","i","m",null,null,null,1,0,1,null,1.0,200,false,false,true,null,true,null,null,0]',
         "does not decode"),
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


def _row4(continued: object, legs: object, reason: object, reprefill: object) -> bytes:
    tail = orjson.dumps([continued, legs, reason, reprefill])[1:]
    return (
        b'[4,"r",1,1.0,"eu","eu","i","m",null,null,null,1,0,1,null,1.0,200,true,false,true,null,'
        + tail
    )


@pytest.mark.parametrize(
    ("fields", "why"),
    [
        ((-1, None, None, 0), "continued must be within 0..16"),
        ((17, ",".join(["eu/i"] * 18), "engine_lost", 5), "continued must be within 0..16"),
        ((1, "eu/a,eu/b", "engine_lost", -5), "reprefill_tokens must be >= 0"),
        ((0, "eu/a", None, 0), "for a continued record only"),
        ((0, "eu/a", "engine_lost", 0), "for a continued record only"),
        ((0, None, None, 12), "for a continued record only"),
        ((0, None, "", 0), "continuation_reason must be 1..64"),
        ((1, None, "engine_lost", 12), "names its legs"),
        ((1, "eu/" + "i" * 1030 + ",eu/b", "engine_lost", 12), "names its legs, within 1024"),
        ((2, "eu/a,eu/b", "engine_lost", 12), "'region/instance' joined by ','"),
        ((1, "eu/a,", "engine_lost", 12), "'region/instance' joined by ','"),
        ((1, "eu/a,b", "engine_lost", 12), "'region/instance' joined by ','"),
        ((1, "eu/a,/b", "engine_lost", 12), "'region/instance' joined by ','"),
        ((1, "eu/a,eu/b", "", 12), "continuation_reason must be 1..64"),
        ((1, "eu/a,eu/b", "x" * 65, 12), "continuation_reason must be 1..64"),
    ],
)
def test_bad_continuation_fields_are_refused(fields: tuple[object, ...], why: str) -> None:
    with pytest.raises(UsageRecordError, match=why):
        decode_record(_row4(*fields))


def test_the_continuation_fields_at_their_bounds_are_read() -> None:
    legs = ",".join(f"eu/i-{n:02d}" for n in range(17))
    record = decode_record(_row4(16, legs, "x" * 64, 2**31 - 1))
    assert (record.continued, record.legs, record.reprefill_tokens) == (16, legs, 2**31 - 1)
    # No reason is allowed (an edge that does not know it); no re-prefill too (nothing relayed
    # was counted again).
    assert decode_record(_row4(1, "eu/a,eu/b", None, 0)).continuation_reason is None
    # A stream cut and not continued may say why it was cut.
    cut = decode_record(_row4(0, None, "engine_lost", 0))
    assert (cut.continued, cut.legs, cut.continuation_reason) == (0, None, "engine_lost")
