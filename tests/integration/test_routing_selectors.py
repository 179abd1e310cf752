"""Tables compiled from the demo fleet in PostgreSQL: residency per tenant key, signed
documents the edge decodes and verifies, evacuation, demand from heartbeat load."""

from __future__ import annotations

from io import StringIO

import orjson
import pytest
from django.core.management import call_command

from federation.inventory import services as inventory
from federation.inventory.models import Deployment, Instance, Region
from federation.routing.compiler import compile_fleet_tables, fleet_plan
from federation.routing.selectors import fleet_snapshot
from federation.tenancy import services as tenancy
from federation.tenancy.models import ApiKey, Tenant
from regions.tables.schema import decode_table
from regions.tables.signing import SignatureError, sign, verify
from tests.integration.inventory_factories import make_instance

KEY = "integration-signing-key"
M8 = "meta-llama/Llama-3.1-8B-Instruct"
M70 = "meta-llama/Llama-3.3-70B-Instruct"


def _demo_fleet() -> None:
    """loaddemo, plus ready instances for every deployment and an edge per region."""
    call_command("loaddemo", stdout=StringIO())
    port = 20000
    for dep in Deployment.objects.select_related("pool__region", "model").order_by("pk"):
        for i in range(dep.desired_replicas):
            port += 1
            make_instance(
                dep, f"i{dep.pk}-{dep.role}-{i}", "ready", endpoint_url=f"http://127.0.0.1:{port}"
            )
    for offset, region in enumerate(Region.objects.order_by("code"), start=1):
        inventory.edge_register(
            actor=None,
            region=region,
            name=f"edge-{region.code}",
            url=f"http://127.0.0.1:{7000 + offset}",
        )


def _compile() -> dict[str, dict]:
    snapshot = fleet_snapshot()
    versions = {r.code: 1 for r in snapshot.regions}
    return compile_fleet_tables(snapshot, versions=versions, generated_at="2026-11-29T10:00:00Z")


def _by_key(doc: dict, slug: str) -> dict:
    key_hash = ApiKey.objects.get(tenant__slug=slug, name="demo").key_hash
    return next(t for t in doc["tenants"] if key_hash in t["key_hashes"])


@pytest.mark.django_db
def test_demo_fleet_tables_enforce_residency_and_verify_at_the_edge() -> None:
    _demo_fleet()
    tables = _compile()
    assert set(tables) == {"ap-southeast", "eu-west", "us-east"}
    for code, doc in tables.items():
        signed = orjson.dumps(sign(doc, KEY, "k1"))
        table = verify(signed, {"k1": KEY})
        assert table.region == code and decode_table(signed).version == 1
        globex = _by_key(doc, "globex-eu")
        assert globex["tenant"] == "globex-eu" and globex["allowed_regions"] == ["eu-west"]
        initech = _by_key(doc, "initech")
        assert initech["allowed_regions"] == ["ap-southeast", "eu-west", "us-east"]
        assert initech["requests_per_s"] is None and initech["budget_state"] == "ok"
        assert _by_key(doc, "acme-us")["requests_per_s"] == 10.0  # 600 per minute
        classes = {c["id"]: c for c in doc["residency_classes"]}
        # The 70B model runs in us-east and ap-southeast only: EU-only keys are refused it.
        assert M70 in classes[globex["residency_class"]]["refusals"]
        assert classes[initech["residency_class"]]["refusals"] == {}
        tampered = orjson.loads(signed)
        tampered_globex = next(t for t in tampered["tenants"] if t["tenant"] == "globex-eu")
        tampered_globex["allowed_regions"].append("us-east")
        with pytest.raises(SignatureError):
            verify(orjson.dumps(tampered), {"k1": KEY})
    eu = tables["eu-west"]
    assert {i["model"] for i in eu["instances"]} >= {M8, "Qwen/Qwen2.5-32B-Instruct"}
    route70 = next(r for r in eu["routes"] if r["model"] == M70)
    assert route70["local_capacity_tokens_per_s"] == 0.0
    assert {r["code"] for r in route70["remotes"]} == {"ap-southeast", "us-east"}
    # An unchanged fleet compiles to the same bytes.
    assert {c: orjson.dumps(d) for c, d in _compile().items()} == {
        c: orjson.dumps(d) for c, d in tables.items()
    }


@pytest.mark.django_db
def test_an_isolated_tenant_gets_a_secret_stable_cache_salt() -> None:
    _demo_fleet()
    tables = _compile()
    assert _by_key(tables["eu-west"], "globex-eu")["cache_salt"] is None  # shared by default
    tenant = Tenant.objects.get(slug="globex-eu")
    tenancy.tenant_update(actor=None, tenant=tenant, data={"isolate_kv_cache": True})
    salted = _compile()
    salt = _by_key(salted["eu-west"], "globex-eu")["cache_salt"]
    assert isinstance(salt, str) and len(salt) == 43 and "globex" not in salt
    assert _by_key(salted["us-east"], "globex-eu")["cache_salt"] == salt  # one salt fleet-wide
    assert _by_key(salted["eu-west"], "initech")["cache_salt"] is None
    assert _compile() == salted  # stable: the same tables next time
    # The edge reads it from the table.
    signed = orjson.dumps(sign(salted["eu-west"], KEY, "k1"))
    policy = next(t for t in decode_table(signed).tenants or () if t.tenant == "globex-eu")
    assert policy.cache_salt == salt


@pytest.mark.django_db
def test_evacuation_and_heartbeat_load_reach_the_tables() -> None:
    _demo_fleet()
    inst = Instance.objects.filter(
        deployment__pool__region__code="us-east", deployment__model__name=M8
    ).first()
    assert inst is not None
    inst.load = {"tokens_per_s": 1234.5, "healthy": True}
    inst.save(update_fields=["load"])
    plan = fleet_plan(fleet_snapshot())
    assert plan.demand == {("us-east", M8): 1234.5}
    inventory.region_evacuate(actor=None, region=Region.objects.get(code="ap-southeast"))
    tables = _compile()
    assert tables["ap-southeast"]["instances"] == []
    for doc in tables.values():
        assert "ap-southeast" not in {r["code"] for r in doc["remote_regions"]}
    umbrella = _by_key(tables["us-east"], "umbrella-sg")
    refusals = {c["id"]: c for c in tables["us-east"]["residency_classes"]}[
        umbrella["residency_class"]
    ]["refusals"]
    assert refusals[M8] == "residency"


@pytest.mark.django_db
def test_a_regions_live_edges_are_listed_for_spill_over() -> None:
    from datetime import timedelta

    from django.utils import timezone

    from federation.inventory.models import Edge

    _demo_fleet()
    [single] = {t["region"]: t for t in _compile().values()}["eu-west"]["remote_regions"][:1]
    assert "edges" not in single  # one edge per region: a schema-3 document as before
    us = Region.objects.get(code="us-east")
    for name, port in (("edge-us-east-2", 7102), ("edge-us-east-3", 7103)):
        inventory.edge_register(actor=None, region=us, name=name, url=f"http://127.0.0.1:{port}")
    # edge-us-east-3 went quiet; the first registered one never reported (just registered).
    Edge.objects.filter(name="edge-us-east-3").update(
        last_heartbeat_at=timezone.now() - timedelta(minutes=10)
    )
    tables = {t["region"]: t for t in _compile().values()}
    eu = tables["eu-west"]
    [remote] = [r for r in eu["remote_regions"] if r["code"] == "us-east"]
    first = Edge.objects.get(name="edge-us-east").url
    assert (remote["edge_url"], remote["edges"]) == (first, ["http://127.0.0.1:7102"])
    assert eu["schema_version"] == 4
    assert decode_table(orjson.dumps(eu)).remote_regions  # the edge reads it
    # us-east's own table counts its two live edges: each enforces half of every rate limit.
    us_doc = tables["us-east"]
    assert (us_doc["schema_version"], us_doc["local_edges"]) == (5, 2)
    assert "local_edges" not in eu  # one edge: no field
    assert decode_table(orjson.dumps(us_doc)).local_edges == 2
