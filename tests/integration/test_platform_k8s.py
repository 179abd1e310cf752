"""``platform/k8s/``: the control-plane base and every region overlay render with ``kubectl
kustomize`` (offline) and every document validates against the Kubernetes schemas that
``kubernetes-validate`` ships; then what the manifests promise is checked: one beat, probes on
the real health endpoints, resource requests, secrets referenced and never shipped, only
commands and flags ``fedinfer`` has, vLLM with the project's flags and a GPU per TP rank, and a
multi-node engine that is the Kubernetes provisioner's own LeaderWorkerSet. kubectl is the
Debian/upstream binary ``.ci/run`` installs: missing, these tests fail."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from django.urls import resolve

from federation.fleet.spec import EngineSpec
from tests.integration.test_platform_docker import help_of
from workers.provisioners.kubernetes import Cluster
from workers.provisioners.kubernetes import render as provisioner_render

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "platform" / "k8s"
KUBECTL = Path("/usr/bin/kubectl")
#: The Kubernetes version the manifests are validated for (kubernetes-validate's schemas).
K8S_VERSION = "1.30"
OVERLAYS = sorted(p.parent for p in (K8S / "overlays").glob("*/kustomization.yaml"))
#: Flags the project runs vLLM with (tests/vllm/servers.py), plus the TP size.
VLLM_FLAGS = {
    "--served-model-name",
    "--host",
    "--port",
    "--max-model-len",
    "--max-num-seqs",
    "--enable-prefix-caching",
    "--prefix-caching-hash-algo",
    "--enable-prompt-tokens-details",
    "--tensor-parallel-size",
    "--kv-events-config",
}
FEDINFER_IMAGE = "registry.example.com/fedinfer:0.1.0"
#: The LeaderWorkerSet API (``leaderworkerset.x-k8s.io/v1``) as far as the manifests use it:
#: kubernetes-validate has no schema for a CRD, so its spec is checked here and its pod
#: templates against the core Pod schema (:func:`lws_errors`).
LWS_SCHEMA = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "leaderworkerset.x-k8s.io/v1"},
        "kind": {"const": "LeaderWorkerSet"},
        "metadata": {"type": "object", "required": ["name"]},
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "required": ["leaderWorkerTemplate"],
            "properties": {
                "replicas": {"type": "integer", "minimum": 0},
                "startupPolicy": {"enum": ["LeaderCreated", "LeaderReady"]},
                "rolloutStrategy": {"type": "object"},
                "networkConfig": {"type": "object"},
                "leaderWorkerTemplate": {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["workerTemplate"],
                    "properties": {
                        "size": {"type": "integer", "minimum": 1},
                        "restartPolicy": {
                            "enum": ["RecreateGroupOnPodRestart", "RecreateGroupAfterStart", "None"]
                        },
                        "leaderTemplate": {"type": "object", "required": ["spec"]},
                        "workerTemplate": {"type": "object", "required": ["spec"]},
                        "subGroupPolicy": {"type": "object"},
                        "volumeClaimTemplates": {"type": "array"},
                    },
                },
            },
        },
    },
}
#: The us-east overlay's multi-node engine, as the inventory would describe it to the
#: provisioner (platform/k8s/overlays/us-east/vllm-405b.yaml is its rendering).
MULTI_NODE = EngineSpec(
    name="vllm-405b",
    url="",
    model="meta-llama/Llama-3.1-405B-Instruct-FP8",
    served_model_name="meta-llama/Llama-3.1-405B-Instruct-FP8",
    tensor_parallel_size=16,
    gpus_per_node=8,
    max_model_len=32768,
    engine_args={"max-num-seqs": 128},
)


def render(path: Path) -> list[dict[str, Any]]:
    if not KUBECTL.exists():
        pytest.fail(f"{KUBECTL} is missing: install kubectl (.ci/run does)")
    result = subprocess.run(
        [str(KUBECTL), "kustomize", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return [d for d in yaml.safe_load_all(result.stdout) if d]


def lws_templates(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    group = doc["spec"]["leaderWorkerTemplate"]
    return {k: group[k] for k in ("leaderTemplate", "workerTemplate") if k in group}


def lws_errors(doc: dict[str, Any]) -> list[str]:
    """A LeaderWorkerSet: its spec against :data:`LWS_SCHEMA`, each pod template as a Pod."""
    name = f"LeaderWorkerSet/{doc['metadata']['name']}"
    errors = [
        f"{name}: {e.message}" for e in jsonschema.Draft202012Validator(LWS_SCHEMA).iter_errors(doc)
    ]
    if errors:
        return errors
    for key, template in lws_templates(doc).items():
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "p", **template.get("metadata", {})},
            "spec": template["spec"],
        }
        try:
            kubernetes_validate.validate(pod, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            errors.append(f"{name} {key}: {exc.message}")
    return errors


def validation_errors(documents: list[dict[str, Any]]) -> list[str]:
    errors = []
    for doc in documents:
        if doc["kind"] == "LeaderWorkerSet":
            errors += lws_errors(doc)
            continue
        try:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        except kubernetes_validate.SchemaNotFoundError as exc:
            errors.append(f"{doc['kind']}: no schema (a CRD needs its own, docs): {exc}")
        except kubernetes_validate.ValidationError as exc:
            errors.append(f"{doc['kind']}/{doc['metadata']['name']}: {exc.message}")
    return errors


def of_kind(documents: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in documents if d["kind"] == kind}


def pod_specs(documents: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    kinds = ("Deployment", "StatefulSet", "Job")
    specs = {
        f"{d['kind']}/{d['metadata']['name']}": d["spec"]["template"]["spec"]
        for d in documents
        if d["kind"] in kinds
    }
    for d in documents:
        if d["kind"] == "LeaderWorkerSet":
            for key, template in lws_templates(d).items():
                specs[f"LeaderWorkerSet/{d['metadata']['name']}/{key}"] = template["spec"]
    return specs


def test_there_is_a_base_and_two_region_overlays() -> None:
    assert [p.name for p in OVERLAYS] == ["eu-west", "us-east"]


@pytest.mark.parametrize("path", [K8S / "base", *OVERLAYS], ids=lambda p: p.name)
def test_every_document_validates_against_the_kubernetes_schemas(path: Path) -> None:
    documents = render(path)
    assert len(documents) > 8
    assert validation_errors(documents) == []
    # Secrets are references: the operator creates them (docs/deployment.md), never the repo.
    assert not of_kind(documents, "Secret")


def test_validation_refuses_a_broken_manifest() -> None:
    documents = render(OVERLAYS[0])
    edge = next(d for d in documents if d["kind"] == "StatefulSet")
    edge["spec"]["replicas"] = "two"
    edge["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]["httpGet"]["port"] = [1]
    documents.append({"apiVersion": "example.com/v1", "kind": "Gadget", "metadata": {"name": "x"}})
    errors = validation_errors(documents)
    assert len(errors) == 2, errors
    assert "Gadget: no schema" in errors[1]


def test_the_control_plane_runs_one_beat_and_workers_without_it() -> None:
    documents = render(K8S / "base")
    deployments = of_kind(documents, "Deployment")
    beat = deployments["beat"]
    assert beat["spec"]["replicas"] == 1 and beat["spec"]["strategy"]["type"] == "Recreate"
    commands = [
        c["args"]
        for spec in pod_specs(documents).values()
        for c in spec["containers"]
        if c["image"] == FEDINFER_IMAGE
    ]
    assert sum(1 for a in commands if a[0] == "beat") == 1
    workers = [a for a in commands if a[0] == "worker"]
    assert workers and all("--no-beat" in a for a in workers)
    web = deployments["control-plane"]["spec"]["template"]["spec"]["containers"][0]
    assert web["args"][:2] == ["serve", "--no-migrate"]
    assert web["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert web["readinessProbe"]["httpGet"]["path"] == "/readyz"
    for path in ("/healthz", "/readyz", "/metrics"):
        resolve(path)  # the probes' and Prometheus's paths exist in the control plane
    (job,) = of_kind(documents, "Job").values()
    assert job["spec"]["template"]["spec"]["containers"][0]["args"] == ["migrate", "--noinput"]


def test_every_container_requests_resources_and_uses_only_real_commands_and_flags() -> None:
    for path in [K8S / "base", *OVERLAYS]:
        for name, spec in pod_specs(render(path)).items():
            for container in spec["containers"]:
                requests = container["resources"]["requests"]
                assert {"cpu", "memory"} <= set(requests), (name, container["name"])
                if container["image"] != FEDINFER_IMAGE:
                    continue
                command, *args = container["args"]
                text = help_of(command)
                for flag in (a.split("=")[0] for a in args if a.startswith("--")):
                    assert re.search(rf"(^|[\s,\[]){re.escape(flag)}\b", text), (name, flag)


@pytest.mark.parametrize("overlay", OVERLAYS, ids=lambda p: p.name)
def test_a_region_runs_its_edges_and_vllm_on_the_real_health_endpoints(overlay: Path) -> None:
    region = overlay.name
    documents = render(overlay)
    namespaces = of_kind(documents, "Namespace")
    assert list(namespaces) == [f"fedinfer-{region}"]
    (config,) = of_kind(documents, "ConfigMap").values()
    assert config["data"]["FEDINFER_REGION"] == region
    sets = of_kind(documents, "StatefulSet")
    edge = sets[f"{region}-edge"]["spec"]["template"]["spec"]["containers"][0]
    args = dict(a.split("=", 1) for a in edge["args"][1:])
    assert args["--edge-name"] == "$(POD_NAME)"
    assert args["--credential-file"].endswith("/$(POD_NAME)")
    operator = int(args["--operator-port"])
    ports = {p["name"]: p["containerPort"] for p in edge["ports"]}
    assert ports["operator"] == operator and ports["http"] == int(args["--port"])
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert edge[probe]["httpGet"] == {"path": "/healthz", "port": "operator"}
    (hpa,) = of_kind(documents, "HorizontalPodAutoscaler").values()
    assert hpa["spec"]["scaleTargetRef"]["name"] == f"{region}-edge"
    assert of_kind(documents, "PodDisruptionBudget")
    assert len(of_kind(documents, "NetworkPolicy")) >= 3

    vllm = sets[f"{region}-vllm"]["spec"]["template"]["spec"]["containers"][0]
    flags = {a.split("=")[0] for a in vllm["args"] if a.startswith("--")}
    assert flags == VLLM_FLAGS
    env = {e["name"]: e.get("value") for e in vllm["env"]}
    gpus = vllm["resources"]["limits"]["nvidia.com/gpu"]
    assert gpus == vllm["resources"]["requests"]["nvidia.com/gpu"] == env["TENSOR_PARALLEL_SIZE"]
    assert vllm["readinessProbe"]["httpGet"]["path"] == "/health"


def test_the_project_runs_vllm_with_the_flags_the_manifests_use() -> None:
    """The manifests' flags are those of tests/vllm/servers.py (the real vLLM the tests run)."""
    source = (ROOT / "tests" / "vllm" / "servers.py").read_text()
    start = source.index("def server_argv")
    body = source[start : source.index("\n\n\n", start)]  # to the function's end
    used = set(re.findall(r'"(--[a-z-]+)"', body))
    # (the KV-event tests add --kv-events-config: tests/vllm/test_kv_events_vllm.py)
    assert used - {"--model", "--dtype"} == VLLM_FLAGS - {
        "--tensor-parallel-size",
        "--kv-events-config",
    }


@pytest.mark.parametrize("overlay", OVERLAYS, ids=lambda p: p.name)
def test_kv_events_bind_on_the_pod_ip_and_only_the_edges_reach_them(overlay: Path) -> None:
    """vLLM publishes its KV events on the pod's own IP (vLLM binds an endpoint with "::";
    not every interface), and of all the region's pods only the edges may connect."""
    documents = render(overlay)
    vllm = of_kind(documents, "StatefulSet")[f"{overlay.name}-vllm"]["spec"]["template"]
    (container,) = vllm["spec"]["containers"]
    flag = next(a for a in container["args"] if a.startswith("--kv-events-config="))
    config = json.loads(flag.split("=", 1)[1])
    assert config["endpoint"] == "tcp://[::ffff:$(POD_IP)]:5557"
    assert "::" in config["endpoint"] and "*" not in config["endpoint"]
    pod_ip = {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}
    assert pod_ip in container["env"]
    assert {"name": "kv-events", "containerPort": 5557} in container["ports"]
    labels = vllm["metadata"]["labels"]
    admitted = []  # (from, ports) of every policy rule that selects the vLLM pods
    for policy in of_kind(documents, "NetworkPolicy").values():
        selector = policy["spec"]["podSelector"].get("matchLabels", {})
        if selector.items() <= labels.items():
            for rule in policy["spec"].get("ingress", []):
                ports = {p["port"] for p in rule.get("ports", [])} or {"any"}
                admitted.append((rule.get("from", "anyone"), ports))
    reach_events = [peers for peers, ports in admitted if ports & {5557, "any"}]
    edges = [{"podSelector": {"matchLabels": {"app.kubernetes.io/name": "edge"}}}]
    assert reach_events == [edges]


def test_tensor_parallelism_across_nodes_is_the_provisioners_leader_worker_set() -> None:
    """us-east's 405B engine spans two nodes: its LeaderWorkerSet and Service are what the
    Kubernetes provisioner renders for it, changed only where the overlay says why."""
    documents = render(K8S / "overlays" / "us-east")
    (lws,) = of_kind(documents, "LeaderWorkerSet").values()
    service = of_kind(documents, "Service")["us-east-vllm-405b"]
    statefulset_image = of_kind(documents, "StatefulSet")["us-east-vllm"]["spec"]["template"][
        "spec"
    ]["containers"][0]["image"]
    cluster = Cluster(namespace="fedinfer-us-east", image=statefulset_image)
    expected, expected_service = provisioner_render(MULTI_NODE, cluster)
    # The file in the overlay is the rendering itself (kustomize adds the rest).
    source = list(yaml.safe_load_all((K8S / "overlays" / "us-east" / "vllm-405b.yaml").read_text()))
    assert source == [expected, expected_service]

    group, want = lws["spec"]["leaderWorkerTemplate"], expected["spec"]["leaderWorkerTemplate"]
    assert group["size"] == want["size"] == 2
    assert group["restartPolicy"] == want["restartPolicy"]
    for key, template in lws_templates(lws).items():
        (container,) = template["spec"]["containers"]
        (rendered,) = want[key]["spec"]["containers"]
        for field in ("image", "command", "env", "volumeMounts"):
            assert container[field] == rendered[field], (key, field)
        assert container.get("ports") == rendered.get("ports")
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert container.get(probe) == rendered.get(probe), (key, probe)
        gpus = container["resources"]["limits"]["nvidia.com/gpu"]
        assert gpus == container["resources"]["requests"]["nvidia.com/gpu"] == "8"
        labels = template["metadata"]["labels"]
        # Not the provisioner's to manage (it would stop an engine no instance claims), and
        # in the region for Prometheus' relabelling.
        assert labels["app.kubernetes.io/managed-by"] != "fedinfer"
        assert labels["fedinfer.io/region"] == "us-east"
        assert labels["fedinfer.io/instance"] == "vllm-405b"
    leader = group["leaderTemplate"]["spec"]["containers"][0]["command"][2]
    assert "--tensor-parallel-size 16" in leader and "--distributed-executor-backend ray" in leader
    assert lws["metadata"]["labels"]["app.kubernetes.io/managed-by"] != "fedinfer"
    # The Service reaches the leader, at the URL the engine is registered under.
    assert service["spec"]["selector"] == expected_service["spec"]["selector"]
    assert service["spec"]["ports"] == expected_service["spec"]["ports"]
    url = f"http://{service['metadata']['name']}.{service['metadata']['namespace']}.svc:8000"
    assert lws["metadata"]["annotations"]["fedinfer.io/url"] == url
    assert service["metadata"]["annotations"]["fedinfer.io/url"] == url
    # The group's pods reach each other on every port (Ray, NCCL).
    policy = of_kind(documents, "NetworkPolicy")["us-east-vllm-405b-group"]
    assert policy["spec"]["podSelector"]["matchLabels"] == {"fedinfer.io/instance": "vllm-405b"}
    assert {"podSelector": {"matchLabels": {"fedinfer.io/instance": "vllm-405b"}}} in policy[
        "spec"
    ]["ingress"][0]["from"]


def test_the_leader_worker_set_check_refuses_a_broken_one() -> None:
    documents = render(K8S / "overlays" / "us-east")
    (lws,) = of_kind(documents, "LeaderWorkerSet").values()
    assert lws_errors(lws) == []
    lws["spec"]["leaderWorkerTemplate"]["size"] = "two"
    assert any("'two' is not of type 'integer'" in e for e in lws_errors(lws))
    lws["spec"]["leaderWorkerTemplate"]["size"] = 2
    worker = lws["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]
    worker["resources"]["limits"]["nvidia.com/gpu"] = {"count": 8}
    (error,) = lws_errors(lws)
    assert error.startswith("LeaderWorkerSet/us-east-vllm-405b workerTemplate:")
