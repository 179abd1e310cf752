"""A cold adapter costs its base model's price at the edge's budget hold: an adapter loaded
where its demand appears (or of a deployment scaled to zero) names no instance in the table,
and was held at no price, so a budget never stopped its requests."""

from __future__ import annotations

from dataclasses import replace

import orjson

from federation.routing.compiler import compile_region_table
from federation.routing.leases import BudgetRow
from federation.routing.snapshot import TenantRow
from regions.edge.policy.budget import Budgets
from regions.tables.money import request_pusd
from regions.tables.schema import (
    COLD_SCHEMA_VERSION,
    ColdModel,
    Instance,
    ModelPrice,
    RoutingTable,
    TenantPolicy,
    decode_table,
)
from tests.unit.test_budget_leases import PRICE, leased
from tests.unit.test_routing_compiler import SNAPSHOT

WORST = request_pusd(PRICE, prompt_tokens=100, cached_tokens=0, completion_tokens=100)


def cold_table(prices: dict[str, ModelPrice]) -> RoutingTable:
    """``m`` served here; ``z``'s deployment scaled to zero with its adapter ``z-lora``, and
    ``m-new`` a registered adapter of ``m`` that no replica has loaded yet."""
    return RoutingTable(
        schema_version=COLD_SCHEMA_VERSION,
        version=1,
        region="r",
        generated_at="2026-12-01T00:00:00Z",
        instances=(Instance(id="i", url="http://i:1", model="m"),),
        tenants=(TenantPolicy(tenant="acme", budget=leased(2 * 10**9, {}, ["a"])),),
        prices=prices,
        cold_models=(ColdModel(model="z", adapters=("z-lora",)), ColdModel(model="m-new")),
    )


def test_an_adapter_of_a_cold_deployment_is_held_at_its_base_models_price() -> None:
    budgets = Budgets("a")
    budgets.load(cold_table({"m": PRICE, "z": PRICE}))
    hold = budgets.reserve("acme", None, "z-lora", prompt_tokens=100, output_tokens=100)
    assert hold is not None and hold.amount == WORST > 0


def test_a_loadable_adapter_is_held_at_the_price_the_table_gives_it() -> None:
    snapshot = replace(
        SNAPSHOT,
        tenants=(
            TenantRow(
                "acme",
                budget=BudgetRow(
                    month="2026-12", budget=10**12, counted={}, published={}, committed={}
                ),
            ),
        ),
        prices={"m-8b": PRICE},
        adapter_bases={"m-8b-new": "m-8b", "m-8b-sql": "m-8b", "x-lora": "unpriced"},
        plans={},  # its own plan memo: SNAPSHOT's would be given this budgeted plan
    )
    doc = compile_region_table(snapshot, region="us-east", version=1, generated_at="x")
    table = decode_table(orjson.dumps(doc))
    assert table.prices == {"m-8b": PRICE, "m-8b-new": PRICE, "m-8b-sql": PRICE}
    budgets = Budgets("a")
    budgets.load(cold_table({"m": PRICE, "m-new": table.prices["m-8b-new"]}))
    hold = budgets.reserve("acme", None, "m-new", prompt_tokens=100, output_tokens=100)
    assert hold is not None and hold.amount == WORST
