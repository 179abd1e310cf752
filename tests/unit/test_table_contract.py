"""One table contract: whatever fleet the compiler is given, each region's table it builds is a
valid document of ``regions/tables/schema.py`` that the edge decodes back to the same Structs —
signed, through JSON, as the edges receive it."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import msgspec
import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from federation.routing.compiler import fleet_plan, region_table
from federation.routing.snapshot import (
    FleetSnapshot,
    InstanceRow,
    KeyRow,
    RampPolicy,
    RegionRow,
    TenantRow,
)
from federation.tenancy.residency import ResidencyPolicy
from regions.tables.schema import SCHEMA_VERSION, decode_table, encode_table
from regions.tables.signing import sign, verify

NOW = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)
CODES = ("us-east", "eu-west", "eu-north", "ap-south")
JURISDICTION = {"us-east": "US", "eu-west": "EU", "eu-north": "EU", "ap-south": "APAC"}
MODELS = ("llama-8b", "llama-70b", "qwen-7b")


@st.composite
def regions(draw: st.DrawFn) -> tuple[RegionRow, ...]:
    codes = draw(st.lists(st.sampled_from(CODES), min_size=1, max_size=4, unique=True))
    rows = []
    for code in codes:
        ago = draw(st.none() | st.floats(0, 120))
        rows.append(
            RegionRow(
                code,
                draw(st.sampled_from(("active", "active", "evacuated"))),
                JURISDICTION[code],
                edge_url=draw(st.none() | st.just(f"http://edge.{code}:8200/")),
                restored_at=None if ago is None else NOW - timedelta(seconds=ago),
            )
        )
    return tuple(rows)


@st.composite
def instances(draw: st.DrawFn, codes: list[str]) -> tuple[InstanceRow, ...]:
    rows = []
    for i in range(draw(st.integers(0, 8))):
        region = draw(st.sampled_from(codes))
        rows.append(
            InstanceRow(
                name=f"{region}-{i}",
                endpoint_url=f"http://10.0.0.{i + 1}:8000/",
                state=draw(st.sampled_from(("ready", "ready", "draining", "loading"))),
                region=region,
                model=draw(st.sampled_from(MODELS)),
                role=draw(st.sampled_from(("mixed", "mixed", "prefill", "decode"))),
                accelerator=draw(st.sampled_from(("H100-80G", "A100-80G", "L4"))),
                relative_speed=draw(st.floats(0.1, 2.0)),
                tensor_parallel_size=draw(st.sampled_from((1, 2, 4, 8))),
                parameter_count_b=draw(st.sampled_from((7.0, 8.0, 70.0))),
                max_num_seqs=draw(st.integers(1, 256)),
                adapters=tuple(draw(st.lists(st.sampled_from(("sql", "chat")), unique=True))),
                price_per_gpu_hour=draw(st.floats(0.0, 10.0)),
                load_tokens_per_s=draw(st.none() | st.floats(0, 50_000)),
                healthy=draw(st.none() | st.booleans()),
            )
        )
    return tuple(rows)


@st.composite
def tenants(draw: st.DrawFn) -> tuple[TenantRow, ...]:
    rows = []
    for i in range(draw(st.integers(0, 4))):
        keys = tuple(
            KeyRow(
                f"{i}{k}".ljust(64, "a"),
                draw(st.none() | st.just(NOW + timedelta(days=k + 1))),
                draw(st.sampled_from((("inference",), ("usage:read",)))),
            )
            for k in range(draw(st.integers(0, 3)))
        )
        rows.append(
            TenantRow(
                f"tenant-{i}",
                ResidencyPolicy.of(draw(st.lists(st.sampled_from(("US", "EU", "APAC"))))),
                requests_per_minute=draw(st.none() | st.integers(1, 10_000)),
                tokens_per_minute=draw(st.none() | st.integers(1, 10_000_000)),
                monthly_budget_usd=draw(st.none() | st.floats(1.0, 10_000.0)),
                spend_usd=draw(st.floats(0.0, 20_000.0)),
                keys=keys,
                cache_salt=draw(st.none() | st.just(f"salt-{i}")),
            )
        )
    return tuple(rows)


@st.composite
def fleets(draw: st.DrawFn) -> FleetSnapshot:
    region_rows = draw(regions())
    codes = [r.code for r in region_rows]
    pairs = [(a, b) for a in codes for b in codes if a < b]
    rtt = {pair: draw(st.floats(1.0, 300.0)) for pair in pairs if draw(st.booleans())}
    return FleetSnapshot(
        regions=region_rows,
        instances=draw(instances(codes)),
        rtt_ms=rtt,
        tenants=draw(tenants()),
        now=NOW,
        ramp=RampPolicy(window_s=60.0, steps=4),
    )


@settings(max_examples=150, deadline=None)
@given(fleets())
def test_every_compiled_table_round_trips_through_the_edges_decoder(
    snapshot: FleetSnapshot,
) -> None:
    plan = fleet_plan(snapshot)
    for version, row in enumerate(snapshot.regions, start=1):
        table = region_table(
            snapshot,
            region=row.code,
            version=version,
            generated_at="2026-11-30T12:00:00Z",
            plan=plan,
        )
        document = encode_table(table)
        assert decode_table(orjson.dumps(document)) == table
        signed = sign(document, "k", "k1")
        received = verify(orjson.dumps(signed), {"k1": "k"})
        assert msgspec.structs.replace(received, signature=None) == table
        ramping = "ramp" in document or any("ramp" in r for r in document["remote_regions"])
        assert (document["schema_version"] == SCHEMA_VERSION) is not ramping
