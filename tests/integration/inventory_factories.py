"""Builders for inventory rows in tests. They go through the services, like the API does."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from decimal import Decimal
from typing import Any
from unittest import mock

from federation.inventory import services
from federation.inventory.models import (
    AcceleratorType,
    Deployment,
    GPUPool,
    Instance,
    LanguageModel,
    Region,
)


@contextmanager
def services_clock(at: datetime) -> Iterator[None]:
    """The services' clock at ``at``: what they stamp (transitions, revisions) is then."""
    with mock.patch("django.utils.timezone.now", return_value=at):
        yield


LLAMA_8B: dict[str, Any] = {
    "name": "meta-llama/Llama-3.1-8B-Instruct",
    "family": "llama-3.1",
    "parameter_count_b": Decimal("8.03"),
    "dtype": "bf16",
    "weight_size_gib": 15.0,
    "max_context_tokens": 8192,
    "num_layers": 32,
    "num_attention_heads": 32,
    "num_kv_heads": 8,
    "head_dim": 128,
}
LLAMA_70B: dict[str, Any] = {
    **LLAMA_8B,
    "name": "meta-llama/Llama-3.1-70B-Instruct",
    "parameter_count_b": Decimal("70.6"),
    "weight_size_gib": 131.0,
    "max_context_tokens": 131072,
    "num_layers": 80,
    "num_attention_heads": 64,
}


def make_region(code: str = "us-east", jurisdiction: str = "US", **kw: Any) -> Region:
    fields = {
        "name": code.replace("-", " ").title(),
        "provider": "cloud",
        "latitude": 39.0,
        "longitude": -77.5,
        "jurisdiction": jurisdiction,
        **kw,
    }
    return services.region_create(actor=None, code=code, **fields)


def make_pool(region: Region, name: str = "h100", **kw: Any) -> GPUPool:
    fields: dict[str, Any] = {
        "accelerator": AcceleratorType.objects.get(name=kw.pop("accelerator", "H100-80G")),
        "gpus_per_node": 8,
        "node_count": 2,
        "interconnect": "nvlink",
        "price_per_gpu_hour": Decimal("2.50"),
        "capacity_type": "on_demand",
        **kw,
    }
    return services.pool_create(actor=None, region=region, name=name, **fields)


def make_model(spec: dict[str, Any] | None = None, **kw: Any) -> LanguageModel:
    return services.model_create(actor=None, **{**(spec or LLAMA_8B), **kw})


def make_deployment(model: LanguageModel, pool: GPUPool, tp: int = 1, **kw: Any) -> Deployment:
    return services.deployment_create(
        actor=None, model=model, pool=pool, tensor_parallel_size=tp, **kw
    )


def make_instance(
    deployment: Deployment, name: str, state: str = "pending", *, endpoint_url: str = ""
) -> Instance:
    """An instance walked through the lifecycle services to ``state``, as a provisioner would
    move it; ``endpoint_url`` defaults to a name that resolves nowhere."""
    instance = services.instance_create(
        actor=None,
        deployment=deployment,
        name=name,
        endpoint_url=endpoint_url or f"http://{name}.local:8000",
    )
    path = {
        "pending": [],
        "loading": ["loading"],
        "warming": ["loading", "warming"],
        "ready": ["loading", "warming", "ready"],
        "draining": ["loading", "warming", "ready", "draining"],
        "stopped": ["stopped"],
        "failed": ["failed"],
    }[state]
    for step in path:
        instance = services.instance_transition(actor=None, instance=instance, state=step)
    return instance
