"""Engine command lines and Kubernetes manifests rendered from a deployment's spec (pure); the
manifests checked offline against the Kubernetes schemas (kubernetes-validate)."""

from __future__ import annotations

import json
import shlex
from dataclasses import replace
from typing import Any

import kubernetes_validate
import pytest

from federation.fleet.spec import Adapter, EngineSpec, ProvisionerError
from workers.provisioners.commands import sim_args, vllm_args
from workers.provisioners.kubernetes import (
    Cluster,
    KubernetesProvisioner,
    nodes_for,
    render,
    service_url,
)

K8S_VERSION = "1.30.0"
SPEC = EngineSpec(
    name="us-east-h100-7-abc123",
    url="http://127.0.0.1:18000",
    model="meta-llama/Llama-3.1-8B-Instruct",
    served_model_name="meta-llama/Llama-3.1-8B-Instruct",
    tensor_parallel_size=2,
    gpu_memory_utilization=0.85,
    max_model_len=8192,
    gpus_per_node=8,
    accelerator="H100-80G",
    adapters=(Adapter("sql", "/adapters/sql", 32), Adapter("support", "/adapters/s", 16)),
    engine_args={"max-num-seqs": 128, "enforce-eager": True, "disable-log-stats": False},
    kv_events_port=5557,
)


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def test_the_vllm_command_line_carries_every_flag_of_the_deployment() -> None:
    args = vllm_args(SPEC, host="127.0.0.1", port=18000)
    assert flag(args, "--model") == SPEC.model
    assert flag(args, "--served-model-name") == SPEC.served_model_name
    assert (flag(args, "--host"), flag(args, "--port")) == ("127.0.0.1", "18000")
    assert flag(args, "--tensor-parallel-size") == "2"
    assert flag(args, "--gpu-memory-utilization") == "0.85"
    assert flag(args, "--max-model-len") == "8192"
    assert "--enable-lora" in args
    i = args.index("--lora-modules")
    assert args[i + 1 : i + 3] == ["sql=/adapters/sql", "support=/adapters/s"]
    assert flag(args, "--max-lora-rank") == "32"
    events = json.loads(flag(args, "--kv-events-config"))
    assert events == {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        # the engine's own address only, in the form vLLM binds ("::"; "*" would be every
        # interface, a plain address it would connect to)
        "endpoint": "tcp://[::ffff:127.0.0.1]:5557",
        "topic": "kv-events",
    }
    assert flag(args, "--max-num-seqs") == "128" and "--enforce-eager" in args
    assert "--enable-prefix-caching" in args and "--enable-prompt-tokens-details" in args
    # hashes the edges reproduce from the prompt's tokens (regions/engines/block_hash.py)
    assert flag(args, "--prefix-caching-hash-algo") == "sha256_cbor"
    assert "--disable-log-stats" not in args  # False leaves a flag out


def test_a_minimal_spec_renders_no_optional_flags() -> None:
    spec = EngineSpec(name="x", url="http://127.0.0.1:1", model="m", served_model_name="m")
    args = vllm_args(spec, host="h", port=1)
    for absent in ("--enable-lora", "--max-model-len", "--kv-events-config", "--lora-modules"):
        assert absent not in args


def test_prefill_and_decode_engines_get_a_kv_transfer_connector_unless_given_one() -> None:
    base = EngineSpec(name="x", url="u", model="m", served_model_name="m")
    assert "--kv-transfer-config" not in vllm_args(base, host="h", port=1)
    for role in ("prefill", "decode"):
        args = vllm_args(replace(base, role=role), host="h", port=1)
        assert json.loads(flag(args, "--kv-transfer-config")) == {
            "kv_connector": "NixlConnector",
            "kv_role": "kv_both",
        }
    own = {"kv-transfer-config": {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}}
    args = vllm_args(replace(base, role="prefill", engine_args=own), host="h", port=1)
    assert args.count("--kv-transfer-config") == 1
    assert "LMCacheConnectorV1" in flag(args, "--kv-transfer-config")


def test_an_adapter_rank_rounds_up_to_one_vllm_accepts() -> None:
    spec = EngineSpec(
        name="x", url="u", model="m", served_model_name="m", adapters=(Adapter("a", "p", 40),)
    )
    assert flag(vllm_args(spec, host="h", port=1), "--max-lora-rank") == "64"


@pytest.mark.parametrize(
    "engine_args",
    [{"port": 9}, {"tensor-parallel-size": 4}, {"--max-num-seqs": 1}, {"Max_Num": 1}],
)
def test_engine_args_may_not_override_or_smuggle_flags(engine_args: dict[str, Any]) -> None:
    spec = EngineSpec(name="x", url="u", model="m", served_model_name="m", engine_args=engine_args)
    with pytest.raises(ProvisionerError):
        vllm_args(spec, host="h", port=1)


def test_the_simulator_gets_the_subset_it_models() -> None:
    args = sim_args(SPEC, host="127.0.0.1", port=18000)
    assert flag(args, "--model") == SPEC.served_model_name and flag(args, "--tp") == "2"
    assert flag(args, "--accelerator") == "H100-80G"
    assert "--lora-modules" in args and "--enforce-eager" not in args
    assert flag(args, "--max-num-seqs") == "128"  # the concurrency the autoscaler measures
    assert flag(args, "--prefix-caching-hash-algo") == "sha256_cbor"  # vLLM's hashes
    unknown = EngineSpec(name="x", url="u", model="m", served_model_name="m", accelerator="TPU")
    assert "--accelerator" not in sim_args(unknown, host="h", port=1)


CLUSTER = Cluster(namespace="inference", image="vllm/vllm-openai:v0.32.0")


def validate(manifest: dict[str, Any]) -> None:
    kubernetes_validate.validate(manifest, K8S_VERSION, strict=True)


def as_pod(template: dict[str, Any]) -> dict[str, Any]:
    """A LeaderWorkerSet's pod template as a Pod, so the core schema can check it (the CRD's
    own schema is not in kubernetes-validate)."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "p", **template["metadata"]},
        "spec": template["spec"],
    }


def test_a_group_within_one_node_is_a_deployment_and_a_service_that_validate() -> None:
    deployment, service = render(SPEC, CLUSTER)
    validate(deployment)
    validate(service)
    assert deployment["kind"] == "Deployment" and service["kind"] == "Service"
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "2"
    assert container["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == "8000"
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"http": 8000, "kv-events": 5557}
    command = container["command"]
    assert command[:3] == ["python3", "-m", "vllm.entrypoints.openai.api_server"]
    assert flag(command, "--port") == "8000" and flag(command, "--host") == "0.0.0.0"
    # KV events bound on the pod's IP (downward API), not on every interface
    events = json.loads(flag(command, "--kv-events-config"))
    assert events["endpoint"] == "tcp://[::ffff:$(POD_IP)]:5557"
    pod_ip = {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}
    assert pod_ip in container["env"]
    assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]
    assert service_url(SPEC.name, CLUSTER) == f"http://{SPEC.name}.inference.svc:8000"


def test_tensor_parallelism_across_nodes_is_a_leader_worker_set() -> None:
    spec = EngineSpec(
        name="big-1",
        url="u",
        model="meta-llama/Llama-3.3-70B-Instruct",
        served_model_name="meta-llama/Llama-3.3-70B-Instruct",
        tensor_parallel_size=16,
        gpus_per_node=8,
    )
    assert nodes_for(spec) == 2
    lws, service = render(spec, CLUSTER)
    validate(service)
    assert (lws["apiVersion"], lws["kind"]) == ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet")
    group = lws["spec"]["leaderWorkerTemplate"]
    assert group["size"] == 2
    for template in (group["leaderTemplate"], group["workerTemplate"]):
        validate(as_pod(template))
        (container,) = template["spec"]["containers"]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == "8"
    leader_cmd = group["leaderTemplate"]["spec"]["containers"][0]["command"][2]
    server = shlex.split(leader_cmd.split("&&", 1)[1])
    assert flag(server, "--tensor-parallel-size") == "16"
    assert flag(server, "--distributed-executor-backend") == "ray"
    assert "LWS_LEADER_ADDRESS" in group["workerTemplate"]["spec"]["containers"][0]["command"][2]
    assert service["spec"]["selector"]["role"] == "leader"


def test_a_malformed_manifest_is_refused_by_the_schema_check() -> None:
    """The check can fail: a GPU limit given as a nested object is not a quantity."""
    deployment, _ = render(SPEC, CLUSTER)
    deployment["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"] = {
        "nvidia.com/gpu": {"count": 2}
    }
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(deployment)


class ApiError(Exception):
    def __init__(self, status: int) -> None:
        super().__init__(f"HTTP {status}")
        self.status = status


class FakeCluster:
    """The three client APIs the provisioner uses, over one dict of objects by (kind, name):
    a fake transport, as httpx tests its clients."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str], dict[str, Any]] = {}
        self.down = False

    def _create(self, kind: str, body: dict[str, Any]) -> None:
        if self.down:
            raise ApiError(503)
        key = (kind, body["metadata"]["name"])
        if key in self.objects:
            raise ApiError(409)
        self.objects[key] = body

    def _delete(self, kind: str, name: str) -> None:
        if self.objects.pop((kind, name), None) is None:
            raise ApiError(404)

    def _list(self, kind: str, selector: str) -> list[dict[str, Any]]:
        if self.down:
            raise ApiError(503)
        key, _, value = selector.partition("=")
        return [
            o
            for (k, _), o in self.objects.items()
            if k == kind and o["metadata"]["labels"].get(key) == value
        ]

    # apps/v1
    def create_namespaced_deployment(self, ns: str, body: dict[str, Any]) -> None:
        self._create("Deployment", body)

    def delete_namespaced_deployment(self, name: str, ns: str) -> None:
        self._delete("Deployment", name)

    def list_namespaced_deployment(self, ns: str, label_selector: str) -> Any:
        class Meta:
            def __init__(self, name: str) -> None:
                self.name = name

        class Item:
            def __init__(self, o: dict[str, Any]) -> None:
                self.metadata = Meta(o["metadata"]["name"])

        class Listed:
            items = [Item(o) for o in self._list("Deployment", label_selector)]

        return Listed()

    # core/v1
    def create_namespaced_service(self, ns: str, body: dict[str, Any]) -> None:
        self._create("Service", body)

    def delete_namespaced_service(self, name: str, ns: str) -> None:
        self._delete("Service", name)

    # custom objects
    def create_namespaced_custom_object(self, g: str, v: str, ns: str, p: str, body: Any) -> None:
        self._create(body["kind"], body)

    def delete_namespaced_custom_object(self, g: str, v: str, ns: str, p: str, name: str) -> None:
        self._delete("LeaderWorkerSet", name)

    def list_namespaced_custom_object(
        self, g: str, v: str, ns: str, p: str, label_selector: str
    ) -> dict[str, Any]:
        return {"items": self._list("LeaderWorkerSet", label_selector)}


def test_the_kubernetes_provisioner_creates_lists_and_deletes_through_the_client() -> None:
    fake = FakeCluster()
    provisioner = KubernetesProvisioner(
        CLUSTER, apps=fake, core=fake, custom=fake, api_error=ApiError
    )
    small = replace(SPEC, url=provisioner.endpoint_for(SPEC.name))
    big = EngineSpec(
        name="big-1",
        url="u",
        model="m",
        served_model_name="m",
        tensor_parallel_size=16,
        gpus_per_node=8,
    )
    provisioner.start(small)
    provisioner.start(small)  # repeated after a crash: already there, not an error
    provisioner.start(big)
    assert set(fake.objects) == {
        ("Deployment", SPEC.name),
        ("Service", SPEC.name),
        ("LeaderWorkerSet", "big-1"),
        ("Service", "big-1"),
    }
    assert set(provisioner.running()) == {SPEC.name, "big-1"}
    assert provisioner.running()["big-1"].url == service_url("big-1", CLUSTER)
    provisioner.stop(SPEC.name)
    provisioner.stop(SPEC.name)  # nothing left to stop: not an error
    assert set(provisioner.running()) == {"big-1"}
    fake.down = True
    with pytest.raises(ProvisionerError, match="503"):
        provisioner.running()
    with pytest.raises(ProvisionerError, match="503"):
        provisioner.start(replace(SPEC, name="other"))
