"""``platform/docker/``: the compose file validates against the compose-spec JSON schema
(vendored with its licence), runs the demo fleet's topology, and uses only commands and flags
``fedinfer`` has; the Dockerfile builds from files that exist, as a user without privileges.
No Docker engine runs here: these checks are offline. ``fedinfer registerdemo``, which the
compose file runs to register its engines and edges, is exercised on PostgreSQL."""

from __future__ import annotations

import copy
import os
import re
import stat
import subprocess
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import orjson
import pytest
import yaml
from django.core.management import CommandError, call_command, get_commands

from federation.demo import fleet
from federation.inventory import lifecycle
from federation.inventory.models import Instance
from federation.routing.models import RoutingTableVersion
from federation.tenancy.selectors import edge_by_credential
from tests.integration.control_plane_support import FEDINFER

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "platform" / "docker"
COMPOSE = DOCKER / "compose.yaml"
SCHEMA = DOCKER / "compose-spec" / "compose-spec.json"
FEDINFER_IMAGE = "${FEDINFER_IMAGE:-fedinfer:dev}"


def compose() -> dict[str, Any]:
    document: dict[str, Any] = yaml.safe_load(COMPOSE.read_text())
    return document


def schema_errors(document: dict[str, Any]) -> list[str]:
    validator = jsonschema.Draft7Validator(orjson.loads(SCHEMA.read_bytes()))
    return [f"{list(e.absolute_path)}: {e.message}" for e in validator.iter_errors(document)]


def fedinfer_services() -> dict[str, dict[str, Any]]:
    return {n: s for n, s in compose()["services"].items() if s["image"] == FEDINFER_IMAGE}


@cache
def help_of(command: str) -> str:
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "federation.settings"}
    result = subprocess.run(
        [FEDINFER, command, "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env=env,
    )
    assert result.returncode == 0, (command, result.stderr[-2000:])
    return result.stdout


def test_the_schema_is_vendored_with_its_licence() -> None:
    assert "Apache License" in (DOCKER / "compose-spec" / "LICENSE").read_text()
    assert orjson.loads(SCHEMA.read_bytes())["title"] == "Compose Specification"


def test_compose_validates_against_the_compose_spec_schema() -> None:
    assert schema_errors(compose()) == []


def test_the_schema_check_refuses_a_broken_compose_file() -> None:
    broken = copy.deepcopy(compose())
    broken["services"]["worker"]["restart_policy"] = "always"  # not a service key
    broken["services"]["redis"]["ports"] = "6379:6379"  # a string, not a list
    errors = schema_errors(broken)
    assert any("restart_policy" in e for e in errors), errors
    assert any("'ports'" in e for e in errors), errors


def test_only_the_edges_public_ports_are_published_beyond_loopback() -> None:
    """The operator listeners (every instance's state and load) and the control plane (demo
    secrets are public defaults) are published on 127.0.0.1 alone; clients reach the edges."""
    exposed: list[str] = []
    edges_public = 0
    for name, service in compose()["services"].items():
        args = service.get("command") or []
        edge_port = args[args.index("--port") + 1] if args[:1] == ["edge"] else None
        for mapping in service.get("ports", []):
            published, container = str(mapping).rsplit(":", 1)
            if container == edge_port:
                edges_public += 1
            elif not published.startswith("127.0.0.1:"):
                exposed.append(f"{name}: {mapping}")
    assert exposed == []
    assert edges_public == 3


def test_every_command_and_flag_in_compose_is_one_fedinfer_has() -> None:
    top_level = set(re.findall(r"^fedinfer ([a-z-]+)\s", help_of("--help"), flags=re.M))
    assert {"serve", "worker", "edge", "engine-sim"} <= top_level
    django = set(get_commands())
    for name, service in fedinfer_services().items():
        command, *args = service["command"]
        assert command in top_level or command in django, (name, command)
        text = help_of(command)
        for flag in (a.split("=")[0] for a in args if a.startswith("--")):
            assert re.search(rf"(^|[\s,\[]){re.escape(flag)}\b", text), (name, flag)


def test_compose_runs_the_demo_topology() -> None:
    services = compose()["services"]
    register = services["register"]["command"]
    engines = [register[i + 1] for i, a in enumerate(register) if a == "--engine"]
    edges = [register[i + 1] for i, a in enumerate(register) if a == "--edge"]
    expected = {f"{r}/{p}/{role}/{m}" for r, p, m, role, *_ in fleet.DEPLOYMENTS}
    assert {e.split("=", 1)[0] for e in engines} == expected
    tp = {f"{r}/{p}/{role}/{m}": t for r, p, m, role, t, *_ in fleet.DEPLOYMENTS}
    for engine in engines:
        key, url = engine.split("=", 1)
        host = url.removeprefix("http://").split(":")[0]
        args = services[host]["command"]
        assert args[0] == "engine-sim"
        assert args[args.index("--model") + 1] == key.split("/", 3)[3]
        assert args[args.index("--tp") + 1] == str(tp[key])
        assert host in services["register"]["depends_on"]
    regions = sorted(r["code"] for r in fleet.REGIONS)
    assert sorted(e.split("=")[0] for e in edges) == regions
    for code in regions:
        edge = services[f"edge-{code}"]["command"]
        assert edge[edge.index("--region") + 1] == code
        assert edge[edge.index("--credential-file") + 1].endswith(f"/demo-{code}")
        assert f"{code}=http://edge-{code}:8080" in edges
    for name in ("control-plane", "worker"):
        assert services[name]["depends_on"]["register"]["condition"] == (
            "service_completed_successfully"
        )
    assert services["control-plane"]["command"][:2] == ["serve", "--no-migrate"]
    assert services["migrate"]["command"] == ["migrate", "--noinput"]
    # What runs for good comes back when it exits (a worker whose broker went away, an edge
    # that crashed), as Kubernetes' Deployments do; one-shot jobs do not.
    for name, service in services.items():
        lasting = name in ("control-plane", "worker") or name.startswith(("edge-", "engine-"))
        assert (service.get("restart") == "unless-stopped") == lasting, name


def test_the_dockerfile_builds_from_what_exists_and_runs_unprivileged() -> None:
    text = (DOCKER / "Dockerfile").read_text()
    stages = re.findall(r"^FROM (\S+)", text, flags=re.M)
    assert stages == ["python:3.11-slim", "python:3.11-slim"]
    for source in re.findall(r"^COPY (?!--from)(.+) \S+$", text, flags=re.M):
        for path in source.split():
            assert (ROOT / path).exists(), path
    assert re.search(r"^USER 10001:10001$", text, flags=re.M)
    assert '\nENTRYPOINT ["fedinfer"]\n' in text
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".git", ".venv", "var", "tests"} <= set(ignored)
    assert not {"federation", "regions", "workers", "console", "migrations"} & set(ignored)


# --- fedinfer registerdemo -------------------------------------------------------------------

LLAMA_EU = "eu-west/a100-pcie/mixed/meta-llama/Llama-3.1-8B-Instruct"
QWEN_EU = "eu-west/a100-pcie/mixed/Qwen/Qwen2.5-32B-Instruct"


@pytest.mark.django_db
def test_registerdemo_registers_engines_and_edges_with_private_credentials(
    tmp_path: Path,
) -> None:
    call_command("loaddemo", verbosity=0)
    creds = tmp_path / "credentials"
    argv = [
        "--engine",
        f"{LLAMA_EU}=http://engine-a:8000",
        "--engine",
        f"{LLAMA_EU}=http://engine-b:8000",
        "--engine",
        f"{QWEN_EU}=http://engine-c:8000",
        "--edge",
        "eu-west=http://edge-eu-west:8080",
        "--edge",
        "us-east=http://edge-us-east:8080",
        "--credentials-dir",
        str(creds),
    ]
    call_command("registerdemo", *argv)
    ready = Instance.objects.filter(name__startswith="demo-", state=lifecycle.READY)
    assert sorted(ready.values_list("name", "endpoint_url")) == [
        ("demo-eu-west-a100-pcie-llama-3-1-8b-instruct-mixed-0", "http://engine-a:8000"),
        ("demo-eu-west-a100-pcie-llama-3-1-8b-instruct-mixed-1", "http://engine-b:8000"),
        ("demo-eu-west-a100-pcie-qwen2-5-32b-instruct-mixed-0", "http://engine-c:8000"),
    ]
    first = (creds / "demo-eu-west").read_text().strip()
    assert stat.S_IMODE((creds / "demo-eu-west").stat().st_mode) == 0o600
    edge = edge_by_credential(first)
    assert edge is not None and (edge.name, edge.url) == (
        "demo-eu-west",
        "http://edge-eu-west:8080",
    )
    table = RoutingTableVersion.objects.filter(region__code="eu-west").order_by("-version").first()
    assert table is not None
    assert {i["id"] for i in table.document["instances"]} == {
        n for n, _ in ready.values_list("name", "endpoint_url")
    }

    # Again: the same names, fresh credentials (the old one stops working).
    call_command("registerdemo", *argv)
    assert Instance.objects.filter(name__startswith="demo-").count() == 3
    assert edge_by_credential(first) is None
    assert edge_by_credential((creds / "demo-eu-west").read_text().strip()) is not None


@pytest.mark.django_db
def test_registerdemo_refuses_what_it_cannot_register(tmp_path: Path) -> None:
    call_command("loaddemo", verbosity=0)
    creds = ["--credentials-dir", str(tmp_path)]
    with pytest.raises(CommandError, match="no such deployment"):
        call_command("registerdemo", "--engine", "eu-west/a100-pcie/mixed/Nope=http://x:1", *creds)
    with pytest.raises(CommandError, match="expected KEY=http"):
        call_command("registerdemo", "--engine", f"{LLAMA_EU}=ftp://x", *creds)
    with pytest.raises(CommandError, match="no region mars"):
        call_command("registerdemo", "--edge", "mars=http://edge:8080", *creds)
    assert not Instance.objects.filter(name__startswith="demo-").exists()
