"""Adapters a tenant owns, through a real edge process and a real (fake) engine: only the
tenants the table allows may use or list one; to any other it does not exist (404
``model_not_found``, the answer for a name nobody registered) and no engine sees the request.
First with a hand-written table, then end to end: the owner set on the control plane, its
signed table applied by a control-plane edge. The API's side is ``test_adapter_owners.py``."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from django.conf import settings as django_settings

from federation.inventory import services as inventory
from federation.routing import services as routing
from federation.tenancy import services as tenancy
from regions.supervisor import Supervisor, free_port, wait_http, wait_until
from tests.integration.control_plane_support import (
    own_redis,
    serve,
    start_control_plane_edge,
    subprocess_env,
    write_table_keys,
)
from tests.integration.inventory_factories import (
    make_deployment,
    make_instance,
    make_model,
    make_pool,
    make_region,
)
from tests.integration.test_edge_support import (
    EdgeProc,
    instance,
    spawn_engine,
    start_edge,
    table_doc,
)


def h(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


TENANTS = [
    {"tenant": "acme", "key_hashes": [h("fi_acme")], "allowed_regions": ["r1"]},
    {"tenant": "globex", "key_hashes": [h("fi_globex")], "allowed_regions": ["r1"]},
]


@pytest.fixture(scope="module")
def edge(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EdgeProc]:
    tmp = tmp_path_factory.mktemp("private-adapters")
    engine = spawn_engine(tmp, "i-1", "--adapters", "acme-lora,shared-lora")
    proc: EdgeProc | None = None
    try:
        wait_http(engine.url + "/health", watch=engine.proc)
        doc = table_doc("r1", 1, [instance(engine, adapters=["acme-lora", "shared-lora"])])
        doc["schema_version"] = 6
        doc["tenants"] = TENANTS
        doc["private_adapters"] = {"acme-lora": ["acme"]}
        proc = start_edge(tmp, doc)
        proc.engines = {engine.name: engine}
        yield proc
    finally:
        if proc is not None:
            proc.proc.stop()
        engine.proc.stop()


def chat(edge: EdgeProc | str, key: str, model: str) -> httpx.Response:
    base = edge if isinstance(edge, str) else edge.url
    return httpx.post(
        base + "/v1/chat/completions",
        json={"model": model, "messages": [{"role": "user", "content": "hi"}]},
        headers={"Authorization": f"Bearer {key}"},
        timeout=10,
    )


def error_of(resp: httpx.Response) -> dict[str, Any]:
    err: dict[str, Any] = resp.json()["error"]
    return err


def listed(edge: EdgeProc | str, key: str) -> list[str]:
    base = edge if isinstance(edge, str) else edge.url
    r = httpx.get(base + "/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=5)
    assert r.status_code == 200
    return [m["id"] for m in r.json()["data"]]


def test_another_tenants_adapter_is_refused_as_if_it_did_not_exist(edge: EdgeProc) -> None:
    served = edge.engines["i-1"].stats()["requests"]
    refused = chat(edge, "fi_globex", "acme-lora")
    unknown = chat(edge, "fi_globex", "nobodys-lora")
    assert refused.status_code == unknown.status_code == 404
    assert error_of(refused)["code"] == error_of(unknown)["code"] == "model_not_found"
    assert error_of(refused)["message"] == error_of(unknown)["message"].replace(
        "nobodys-lora", "acme-lora"
    )
    assert edge.engines["i-1"].stats()["requests"] == served  # never reached an engine


def test_the_owner_and_everyone_for_a_public_adapter_are_served(edge: EdgeProc) -> None:
    own = chat(edge, "fi_acme", "acme-lora")
    assert own.status_code == 200, own.text
    for key in ("fi_acme", "fi_globex"):
        public = chat(edge, key, "shared-lora")
        assert public.status_code == 200, public.text


def test_models_lists_a_private_adapter_to_its_tenants_only(edge: EdgeProc) -> None:
    assert listed(edge, "fi_acme") == ["acme-lora", "llama", "shared-lora"]
    assert listed(edge, "fi_globex") == ["llama", "shared-lora"]


@pytest.mark.django_db(transaction=True)
def test_an_owner_set_on_the_control_plane_is_enforced_by_its_edges(
    procs: Supervisor, settings: Any, tmp_path: Any
) -> None:
    with own_redis(settings, django_settings.REDIS_URL):
        eu = make_region("eu-west", "EU")
        model = make_model()
        engine = spawn_engine(
            tmp_path, "eu-1", "--model", model.name, "--adapters", "acme-lora,shared-lora"
        )
        try:
            wait_http(engine.url + "/health", watch=engine.proc)
            acme = tenancy.tenant_create(actor=None, slug="acme", name="Acme")
            globex = tenancy.tenant_create(actor=None, slug="globex", name="Globex")
            keys = {
                t.slug: tenancy.api_key_create(actor=None, tenant=t, name="k").plaintext
                for t in (acme, globex)
            }
            adapters = [
                inventory.adapter_create(
                    actor=None, base_model=model, name=name, rank=8, source=f"/a/{name}", owner=o
                )
                for name, o in (("acme-lora", acme), ("shared-lora", None))
            ]
            dep = make_deployment(model, make_pool(eu), adapters=adapters)
            make_instance(dep, "eu-1", "ready", endpoint_url=engine.url)
            port, ops_port = free_port(), free_port()
            edge = inventory.edge_register(
                actor=None, region=eu, name="edge-eu-west", url=f"http://127.0.0.1:{port}"
            )
            credential = routing.edge_credential_rotate(actor=None, edge=edge)
            routing.routing_tables_publish()
            env = subprocess_env(django_settings.REDIS_URL)
            cp, _ = serve(procs, env)
            proc = start_control_plane_edge(
                procs,
                region="eu-west",
                control_plane=cp,
                credential=credential,
                table_keys=write_table_keys(procs.log_dir / "table-keys"),
                port=port,
                ops_port=ops_port,
                env=env,
            )
            base = f"http://127.0.0.1:{port}"
            wait_until(
                lambda: "acme-lora" in listed(base, keys["acme"]) if _up(base) else False,
                what="the edge applying the control plane's table",
                watch=proc,
            )
            assert listed(base, keys["globex"]) == [model.name, "shared-lora"]
            refused = chat(base, keys["globex"], "acme-lora")
            assert refused.status_code == 404, refused.text
            assert error_of(refused)["code"] == "model_not_found"
            assert engine.stats()["requests"] == 0
            for key, name in ((keys["acme"], "acme-lora"), (keys["globex"], "shared-lora")):
                served = chat(base, key, name)
                assert served.status_code == 200, served.text
        finally:
            engine.proc.stop()


def _up(base: str) -> bool:
    """Whether the edge answers yet (it starts once it has a table)."""
    try:
        httpx.get(base + "/v1/models", timeout=1)
    except httpx.HTTPError:
        return False
    return True
