"""The Kubernetes provisioner: vLLM workloads rendered from an :class:`EngineSpec` (pure,
:func:`render`) and applied through the official ``kubernetes`` client (the optional extra
``fedinfer[kubernetes]``) when a cluster is configured (``FEDINFER_KUBERNETES_NAMESPACE``).

One instance is one replica group: a Deployment of one pod when its tensor-parallel group fits
on a node, a LeaderWorkerSet (one leader and ``nodes - 1`` workers, Ray across them) when it
spans nodes; and a Service named after the instance, which is the instance's URL. Every object
carries ``app.kubernetes.io/managed-by: fedinfer`` and the instance's name, which is how
:meth:`KubernetesProvisioner.running` lists them.
"""

from __future__ import annotations

import importlib
import math
import shlex
from dataclasses import dataclass, replace
from typing import Any

from federation.fleet.spec import EngineSpec, ProvisionerError, Running
from workers.provisioners.commands import vllm_args

MANAGED_BY = "fedinfer"
INSTANCE_LABEL = "fedinfer.io/instance"
LWS_GROUP, LWS_VERSION, LWS_PLURAL = "leaderworkerset.x-k8s.io", "v1", "leaderworkersets"
RAY_PORT = 6379


@dataclass(frozen=True, slots=True)
class Cluster:
    namespace: str
    image: str
    http_port: int = 8000  # the OpenAI API, /health and /metrics
    kv_events_port: int = 5557
    #: vLLM may take minutes to load weights: the startup probe allows this long.
    startup_timeout_s: int = 1800


def service_url(name: str, cluster: Cluster) -> str:
    return f"http://{name}.{cluster.namespace}.svc:{cluster.http_port}"


def nodes_for(spec: EngineSpec) -> int:
    return math.ceil(spec.tensor_parallel_size / spec.gpus_per_node)


def _labels(spec: EngineSpec) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "vllm",
        "app.kubernetes.io/managed-by": MANAGED_BY,
        INSTANCE_LABEL: spec.name,
    }


def _metadata(spec: EngineSpec, cluster: Cluster) -> dict[str, Any]:
    return {
        "name": spec.name,
        "namespace": cluster.namespace,
        "labels": _labels(spec),
        "annotations": {"fedinfer.io/url": service_url(spec.name, cluster)},
    }


def _probe(path: str, *, period: int, failures: int) -> dict[str, Any]:
    return {
        "httpGet": {"path": path, "port": "http"},
        "periodSeconds": period,
        "failureThreshold": failures,
        "timeoutSeconds": 5,
    }


def _container(
    spec: EngineSpec, cluster: Cluster, *, command: list[str], gpus: int, serves: bool
) -> dict[str, Any]:
    container: dict[str, Any] = {
        "name": "vllm",
        "image": cluster.image,
        "command": command,
        "env": [
            {"name": "VLLM_NO_USAGE_STATS", "value": "1"},
            # The pod's IP, where the KV-event publisher binds (vllm_args' events_host).
            {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            # Adapters are loaded where their demand appears (federation/fleet/adapters.py).
            {"name": "VLLM_ALLOW_RUNTIME_LORA_UPDATING", "value": "True"},
        ],
        "resources": {
            "requests": {"nvidia.com/gpu": str(gpus)},
            "limits": {"nvidia.com/gpu": str(gpus)},
        },
        "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}],
    }
    if serves:
        container["ports"] = [
            {"name": "http", "containerPort": cluster.http_port, "protocol": "TCP"},
            {"name": "kv-events", "containerPort": cluster.kv_events_port, "protocol": "TCP"},
        ]
        container["startupProbe"] = _probe(
            "/health", period=10, failures=max(1, cluster.startup_timeout_s // 10)
        )
        container["readinessProbe"] = _probe("/health", period=5, failures=3)
        container["livenessProbe"] = _probe("/health", period=10, failures=6)
    return container


def _pod_spec(container: dict[str, Any]) -> dict[str, Any]:
    return {
        "containers": [container],
        # GPU nodes are usually tainted for GPU workloads only.
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        # Time for vLLM to finish what it runs when the pod is deleted (the worker drains first).
        "terminationGracePeriodSeconds": 120,
        # Tensor-parallel workers exchange tensors through shared memory.
        "volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory"}}],
    }


def _pod_metadata(labels: dict[str, str], cluster: Cluster) -> dict[str, Any]:
    """Pod labels, and Prometheus scrape annotations on the API port (its /metrics)."""
    return {
        "labels": labels,
        "annotations": {
            "prometheus.io/scrape": "true",
            "prometheus.io/port": str(cluster.http_port),
            "prometheus.io/path": "/metrics",
        },
    }


def _server_command(spec: EngineSpec, cluster: Cluster, *, extra: list[str]) -> list[str]:
    with_events = replace(spec, kv_events_port=cluster.kv_events_port)
    # KV events on the pod's own IP only (POD_IP: the downward API, expanded by the kubelet)
    args = vllm_args(with_events, host="0.0.0.0", port=cluster.http_port, events_host="$(POD_IP)")
    return ["python3", "-m", "vllm.entrypoints.openai.api_server", *args, *extra]


def render(spec: EngineSpec, cluster: Cluster) -> list[dict[str, Any]]:
    """The manifests of one instance: its workload and its Service."""
    nodes = nodes_for(spec)
    pod_labels = _labels(spec)
    if nodes == 1:
        container = _container(
            spec,
            cluster,
            command=_server_command(spec, cluster, extra=[]),
            gpus=spec.tensor_parallel_size,
            serves=True,
        )
        workload: dict[str, Any] = {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": _metadata(spec, cluster),
            "spec": {
                "replicas": 1,
                "selector": {"matchLabels": {INSTANCE_LABEL: spec.name}},
                "strategy": {"type": "Recreate"},  # never two engines on one instance's GPUs
                "template": {
                    "metadata": _pod_metadata(pod_labels, cluster),
                    "spec": _pod_spec(container),
                },
            },
        }
        selector = {INSTANCE_LABEL: spec.name}
    else:
        server = _server_command(spec, cluster, extra=["--distributed-executor-backend", "ray"])
        leader_cmd = f"ray start --head --port={RAY_PORT} && {shlex.join(server)}"
        worker_cmd = f"ray start --address=$(LWS_LEADER_ADDRESS):{RAY_PORT} --block"
        gpus = spec.gpus_per_node
        leader = _container(
            spec, cluster, command=["/bin/sh", "-c", leader_cmd], gpus=gpus, serves=True
        )
        worker = _container(
            spec, cluster, command=["/bin/sh", "-c", worker_cmd], gpus=gpus, serves=False
        )
        workload = {
            "apiVersion": f"{LWS_GROUP}/{LWS_VERSION}",
            "kind": "LeaderWorkerSet",
            "metadata": _metadata(spec, cluster),
            "spec": {
                "replicas": 1,
                "leaderWorkerTemplate": {
                    "size": nodes,
                    "restartPolicy": "RecreateGroupOnPodRestart",
                    "leaderTemplate": {
                        "metadata": _pod_metadata({**pod_labels, "role": "leader"}, cluster),
                        "spec": _pod_spec(leader),
                    },
                    "workerTemplate": {
                        "metadata": {"labels": {**pod_labels, "role": "worker"}},
                        "spec": _pod_spec(worker),
                    },
                },
            },
        }
        selector = {INSTANCE_LABEL: spec.name, "role": "leader"}
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(spec, cluster),
        "spec": {
            "selector": selector,
            "ports": [
                {"name": "http", "port": cluster.http_port, "targetPort": "http"},
                {"name": "kv-events", "port": cluster.kv_events_port, "targetPort": "kv-events"},
            ],
        },
    }
    return [workload, service]


class KubernetesProvisioner:
    """Applies :func:`render`'s manifests through the official client's APIs (apps/v1,
    core/v1, custom objects). Kubernetes keeps the pods running; this creates, lists, deletes."""

    kind = "kubernetes"

    def __init__(
        self, cluster: Cluster, *, apps: Any, core: Any, custom: Any, api_error: type[Exception]
    ) -> None:
        self.cluster = cluster
        self.apps = apps
        self.core = core
        self.custom = custom
        self._errors = api_error

    @classmethod
    def from_environment(cls, cluster: Cluster) -> KubernetesProvisioner:
        """With in-cluster credentials, else the kubeconfig."""
        try:
            k8s = importlib.import_module("kubernetes")
        except ImportError as exc:
            raise ProvisionerError(
                "the kubernetes provisioner needs the official client: "
                "pip install 'fedinfer[kubernetes]'"
            ) from exc
        try:
            k8s.config.load_incluster_config()
        except k8s.config.ConfigException:
            k8s.config.load_kube_config()
        return cls(
            cluster,
            apps=k8s.client.AppsV1Api(),
            core=k8s.client.CoreV1Api(),
            custom=k8s.client.CustomObjectsApi(),
            api_error=k8s.client.exceptions.ApiException,
        )

    def endpoint_for(self, name: str) -> str:
        return service_url(name, self.cluster)

    def start(self, spec: EngineSpec) -> Running:
        ns = self.cluster.namespace
        for manifest in render(spec, self.cluster):
            try:
                if manifest["kind"] == "Deployment":
                    self.apps.create_namespaced_deployment(ns, manifest)
                elif manifest["kind"] == "Service":
                    self.core.create_namespaced_service(ns, manifest)
                else:
                    self.custom.create_namespaced_custom_object(
                        LWS_GROUP, LWS_VERSION, ns, LWS_PLURAL, manifest
                    )
            except self._errors as exc:
                if _status(exc) != 409:  # already there: a start repeated after a crash
                    raise ProvisionerError(f"{manifest['kind']} {spec.name}: {exc}") from exc
        return Running(spec.name, spec.url)

    def stop(self, name: str) -> None:
        ns = self.cluster.namespace
        for delete in (
            lambda: self.apps.delete_namespaced_deployment(name, ns),
            lambda: self.custom.delete_namespaced_custom_object(
                LWS_GROUP, LWS_VERSION, ns, LWS_PLURAL, name
            ),
            lambda: self.core.delete_namespaced_service(name, ns),
        ):
            try:
                delete()
            except self._errors as exc:
                if _status(exc) != 404:
                    raise ProvisionerError(f"delete {name}: {exc}") from exc

    def is_running(self, name: str) -> bool:
        return name in self.running()

    def running(self) -> dict[str, Running]:
        ns, selector = self.cluster.namespace, f"app.kubernetes.io/managed-by={MANAGED_BY}"
        try:
            listed = self.apps.list_namespaced_deployment(ns, label_selector=selector)
        except self._errors as exc:
            raise ProvisionerError(f"list Deployments in {ns}: {exc}") from exc
        names = [d.metadata.name for d in listed.items]
        try:
            sets = self.custom.list_namespaced_custom_object(
                LWS_GROUP, LWS_VERSION, ns, LWS_PLURAL, label_selector=selector
            )
        except self._errors as exc:
            if _status(exc) != 404:  # 404: the LeaderWorkerSet CRD is not installed
                raise ProvisionerError(f"list LeaderWorkerSets in {ns}: {exc}") from exc
        else:
            names += [item["metadata"]["name"] for item in sets.get("items", [])]
        return {n: Running(n, service_url(n, self.cluster)) for n in names}


def _status(exc: Exception) -> int | None:
    """The HTTP status of the client's ApiException."""
    return getattr(exc, "status", None)
