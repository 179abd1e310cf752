"""Provisioners: who starts and stops a pool's engines (``GPUPool.provisioner``).

``local`` runs processes on the worker's machine (``local.py``), ``kubernetes`` applies vLLM
workloads to a cluster (``kubernetes.py``); ``static`` pools are run by the operator, who
registers each instance by URL, and the worker leaves them alone. The interface they share is
``federation.fleet.spec.Provisioner``.
"""

from __future__ import annotations

from django.conf import settings

from federation.fleet.spec import Provisioner
from workers.provisioners.kubernetes import Cluster, KubernetesProvisioner
from workers.provisioners.local import LocalProvisioner


def configured_provisioners() -> dict[str, Provisioner]:
    """The provisioners this worker can drive, by kind: local always, Kubernetes when a
    namespace is configured (``FEDINFER_KUBERNETES_NAMESPACE``)."""
    provisioners: dict[str, Provisioner] = {
        "local": LocalProvisioner(
            settings.FEDINFER_LOCAL_ENGINES_DIR,
            engine=settings.FEDINFER_LOCAL_ENGINE,
            vllm_python=settings.FEDINFER_VLLM_PYTHON,
        )
    }
    if settings.FEDINFER_KUBERNETES_NAMESPACE:
        cluster = Cluster(
            namespace=settings.FEDINFER_KUBERNETES_NAMESPACE,
            image=settings.FEDINFER_KUBERNETES_IMAGE,
        )
        provisioners["kubernetes"] = KubernetesProvisioner.from_environment(cluster)
    return provisioners
