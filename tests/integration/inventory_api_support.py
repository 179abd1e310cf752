"""What the inventory REST API tests share: the API prefix, row counts of every inventory
table and the audit trail (to show a refused request wrote nothing), the audit actions
recorded for an object, and the ``fleet`` (one region, an H100 and an L4 pool, two models)
and ``deployment`` fixtures most of them start from."""

from __future__ import annotations

from typing import Any

import pytest

from federation.core.models import AuditEvent
from federation.inventory.models import (
    Deployment,
    Edge,
    GPUPool,
    Instance,
    LanguageModel,
    LoraAdapter,
    Region,
    RegionLink,
)
from tests.integration.inventory_factories import (
    LLAMA_8B,
    LLAMA_70B,
    make_deployment,
    make_model,
    make_pool,
    make_region,
)

API = "/api/v1"
MODELS = (Region, RegionLink, GPUPool, LanguageModel, LoraAdapter, Deployment, Instance, Edge)


def counts() -> dict[str, int]:
    """Row counts of every inventory table and the audit trail: 'nothing half-written'."""
    rows = {m.__name__: m.objects.count() for m in MODELS}
    rows["audit"] = AuditEvent.objects.count()
    return rows


def actions_for(obj: Any) -> list[str]:
    return list(
        AuditEvent.objects.filter(
            object_type=obj._meta.label_lower, object_id=str(obj.pk)
        ).values_list("action", flat=True)
    )


# Named apart from their functions so a test taking ``fleet`` or ``deployment`` does not
# shadow the import.
@pytest.fixture(name="fleet")
def fleet_fixture(db: None) -> dict[str, Any]:
    """One region with an 16-GPU H100 NVLink pool and a 4-GPU L4 PCIe pool, two models."""
    region = make_region("us-east")
    return {
        "region": region,
        "h100": make_pool(region, "h100"),
        "l4": make_pool(
            region, "l4", accelerator="L4-24G", gpus_per_node=4, node_count=1, interconnect="pcie"
        ),
        "m8": make_model(LLAMA_8B),
        "m70": make_model(LLAMA_70B),
    }


@pytest.fixture(name="deployment")
def deployment_fixture(fleet: dict[str, Any]) -> Deployment:
    return make_deployment(fleet["m8"], fleet["h100"], desired_replicas=2, max_replicas=2)
