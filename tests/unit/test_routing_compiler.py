"""The compiler's documents are what the edge decodes (the contract is the document)."""

from __future__ import annotations

import orjson
import pytest

from federation.routing.compiler import compile_region_table, prefill_tokens_per_s
from federation.routing.snapshot import FleetSnapshot, InstanceRow, RegionRow
from regions.tables.schema import decode_table


def _instance(name: str, region: str, *, state: str = "ready", model: str = "m-8b") -> InstanceRow:
    return InstanceRow(
        name=name,
        endpoint_url=f"http://127.0.0.1:9{len(name)}00/",
        state=state,
        region=region,
        model=model,
        role="mixed",
        accelerator="H100-80G",
        relative_speed=1.0,
        tensor_parallel_size=1,
        parameter_count_b=8.0,
        max_num_seqs=128,
        adapters=("m-8b-sql",),
    )


SNAPSHOT = FleetSnapshot(
    regions=(
        RegionRow("us-east", "active", "US", edge_url="http://127.0.0.1:7001"),
        RegionRow("eu-west", "active", "EU", edge_url="http://127.0.0.1:7002"),
        RegionRow("ap-southeast", "evacuated", "APAC", edge_url="http://127.0.0.1:7003"),
    ),
    instances=(
        _instance("us-1", "us-east"),
        _instance("us-22", "us-east", state="draining"),
        _instance("eu-1", "eu-west", model="m-70b"),
        _instance("ap-1", "ap-southeast"),
    ),
    rtt_ms={("us-east", "eu-west"): 75.0, ("us-east", "ap-southeast"): 220.0},
)


def test_table_lists_only_routable_local_instances_and_decodes_at_the_edge() -> None:
    doc = compile_region_table(
        SNAPSHOT, region="us-east", version=7, generated_at="2026-11-29T10:00:00Z"
    )
    table = decode_table(orjson.dumps(doc))
    assert table.version == 7 and table.region == "us-east"
    assert [i.id for i in table.instances] == ["us-1"]  # draining and remote ones excluded
    assert table.instances[0].adapters == ("m-8b-sql",)
    assert table.instances[0].max_concurrency == 128
    # Registered as http://…/ ; the edge appends /v1/… and /health, so no trailing slash.
    assert table.instances[0].url == "http://127.0.0.1:9400"
    # The evacuated region is never a spill-over target; RTT is symmetric when one way is known.
    assert [(r.code, r.rtt_ms, r.models) for r in table.remote_regions] == [
        ("eu-west", 75.0, ("m-70b", "m-8b-sql"))
    ]


def test_evacuated_region_gets_an_empty_instance_list() -> None:
    doc = compile_region_table(SNAPSHOT, region="ap-southeast", version=1, generated_at="x")
    assert doc["instances"] == []
    assert [r["code"] for r in doc["remote_regions"]] == ["us-east"]


def test_unknown_region_is_refused() -> None:
    with pytest.raises(KeyError, match="mars-1"):
        compile_region_table(SNAPSHOT, region="mars-1", version=1, generated_at="x")


def test_prefill_rate_scales_with_speed_and_tp_and_inversely_with_size() -> None:
    base = prefill_tokens_per_s(relative_speed=1.0, tensor_parallel_size=1, params_b=8.0)
    assert base == pytest.approx(15_000)  # an 8B model on one H100 (as the simulator models it)
    assert prefill_tokens_per_s(
        relative_speed=0.5, tensor_parallel_size=1, params_b=8.0
    ) == pytest.approx(base / 2)
    tp4 = prefill_tokens_per_s(relative_speed=1.0, tensor_parallel_size=4, params_b=8.0)
    assert 3 * base < tp4 < 4 * base  # sub-linear in TP
    assert (
        prefill_tokens_per_s(relative_speed=1.0, tensor_parallel_size=1, params_b=70.0) < base / 8
    )
