"""Deployments' ``engine_args`` are an allowlist of vLLM flags (federation/inventory/
engine_flags.py): nothing can override a flag the platform renders (``--host``), no value can
be read as a flag, flags that run foreign code are an admin's audited decision; and an engine
the local provisioner starts sees none of the control plane's secrets."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import httpx
import pytest
from django.contrib.auth.models import User
from rest_framework.test import APIClient

from federation.core.models import AuditEvent
from federation.fleet.spec import EngineSpec
from federation.inventory.models import Deployment, GPUPool, LanguageModel
from regions.supervisor import LOOPBACK, free_port
from tests.integration.fleet_support import wait_until
from tests.integration.inventory_factories import (
    make_deployment,
    make_model,
    make_pool,
    make_region,
)
from workers.provisioners.local import LocalProvisioner, _environ

API = "/api/v1"
#: What a worker's environment holds that no engine may see.
SECRETS = {
    "FEDINFER_SECRET_KEY": "django-secret-of-the-control-plane",
    "DATABASE_URL": "postgres://fedinfer:hunter2@db.internal:5432/fedinfer",
    "FEDINFER_TABLE_KEYS": "k1:c2lnbmluZy1rZXk=",
    "REDIS_URL": "redis://:hunter2@redis.internal:6379/0",
}


@pytest.fixture
def placed(db: None) -> tuple[LanguageModel, GPUPool]:
    region = make_region()
    return make_model(), make_pool(region)


def create(client: APIClient, placed: tuple[LanguageModel, GPUPool], args: Any) -> Any:
    model, pool = placed
    return client.post(
        f"{API}/deployments/",
        {"model": model.pk, "pool": pool.pk, "tensor_parallel_size": 1, "engine_args": args},
        format="json",
    )


@pytest.mark.parametrize(
    ("args", "named"),
    [
        ({"host": "0.0.0.0"}, "'host'"),
        ({"--host": "0.0.0.0"}, "'--host'"),
        ({"host=0.0.0.0": True}, "'host=0.0.0.0'"),
        ({"port": 9}, "'port'"),
        ({"kv-events-config": "{}"}, "'kv-events-config'"),
        ({"max-num-seqs": "--host=0.0.0.0"}, "'max-num-seqs'"),
        ({"response-role": "--host=0.0.0.0"}, "'response-role'"),
        ({"revision": "-x"}, "'revision'"),
        ({"seed": -1}, "'seed'"),
        ({"cuda-graph-sizes": [1, "--host"]}, "'cuda-graph-sizes'"),
        ({"dtype": "--host"}, "'dtype'"),
        ({"enable-chunked-prefill": "--host=0.0.0.0"}, "'enable-chunked-prefill'"),
        ({"served-model-name": "other"}, "'served-model-name'"),
        ({"no-such-flag": 1}, "'no-such-flag'"),
    ],
)
def test_smuggled_flags_and_values_are_refused_naming_the_flag(
    admin_client: APIClient, placed: tuple[LanguageModel, GPUPool], args: Any, named: str
) -> None:
    """Refused even for an admin: no one may override what the platform renders."""
    r = create(admin_client, placed, args)
    assert r.status_code == 400, r.content
    (message,) = r.json()["engine_args"]
    assert named in message, message
    assert not Deployment.objects.exists()


def test_an_update_is_held_to_the_same_allowlist(
    operator_client: APIClient, placed: tuple[LanguageModel, GPUPool]
) -> None:
    dep = make_deployment(*placed, engine_args={"max-num-seqs": 8})
    r = operator_client.patch(
        f"{API}/deployments/{dep.pk}/",
        {"engine_args": {"max-num-seqs": 8, "host": "0.0.0.0"}},
        format="json",
    )
    assert r.status_code == 400 and "'host'" in r.json()["engine_args"][0], r.content
    dep.refresh_from_db()
    assert dep.engine_args == {"max-num-seqs": 8}


def test_foreign_code_is_an_admins_decision_and_audited(
    operator_client: APIClient,
    admin_client: APIClient,
    admin_user: User,
    placed: tuple[LanguageModel, GPUPool],
) -> None:
    foreign = {"max-num-seqs": 16, "trust-remote-code": True}
    r = create(operator_client, placed, foreign)
    assert r.status_code == 400, r.content
    assert "'trust-remote-code'" in r.json()["engine_args"][0]
    assert "admin" in r.json()["engine_args"][0]
    assert not Deployment.objects.exists()

    r = create(admin_client, placed, foreign)
    assert r.status_code == 201, r.content
    dep = Deployment.objects.get(pk=r.json()["id"])
    event = AuditEvent.objects.get(action="deployment.engine_foreign_code")
    assert event.actor_id == admin_user.pk and event.object_id == str(dep.pk)
    assert event.changes == {"trust-remote-code": [None, True]}

    # An operator may tune the rest around the admin's decision, and may take it away, but
    # not add more foreign code.
    url = f"{API}/deployments/{dep.pk}/"
    r = operator_client.patch(url, {"engine_args": {**foreign, "max-num-seqs": 32}}, format="json")
    assert r.status_code == 200, r.content
    r = operator_client.patch(
        url, {"engine_args": {**foreign, "middleware": ["evil.Middleware"]}}, format="json"
    )
    assert r.status_code == 400 and "'middleware'" in r.json()["engine_args"][0], r.content
    r = operator_client.patch(url, {"engine_args": {"max-num-seqs": 32}}, format="json")
    assert r.status_code == 200, r.content
    assert AuditEvent.objects.filter(action="deployment.engine_foreign_code").count() == 1


def test_a_local_engine_sees_none_of_the_workers_secrets(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The real path: the local provisioner spawns ``fedinfer engine-sim``, which serves; its
    environment, read from /proc, holds none of the worker's secrets."""
    for name, value in SECRETS.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    provisioner = LocalProvisioner(tmp_path / "engines")
    url = f"http://{LOOPBACK}:{free_port()}"
    spec = EngineSpec(
        name="secretless-0",
        url=url,
        model="m",
        served_model_name="m",
        engine_args={"max-num-seqs": 4},
    )
    running = provisioner.start(spec)
    try:
        log = tmp_path / "engines" / "secretless-0.log"

        def serving() -> bool:
            try:
                return httpx.get(f"{url}/health", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(serving, 30, "the engine serving", log)
        environ = _environ(int(running.detail["pid"]))
        assert environ["FEDINFER_ENGINE_NAME"] == "secretless-0"  # how the listing finds it
        assert not set(SECRETS) & set(environ), sorted(environ)
        assert not any(v in "".join(environ.values()) for v in SECRETS.values())
        assert environ["HF_HUB_OFFLINE"] == "1" and environ["PATH"] == os.environ["PATH"]
        assert set(provisioner.running()) == {"secretless-0"}
    finally:
        provisioner.stop("secretless-0")
