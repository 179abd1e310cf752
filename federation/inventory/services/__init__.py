"""Every write to the fleet, one module per entity. Views, tasks and commands call these, never
``save()`` directly; this package is their interface (``services.region_create(...)``), the
modules behind it are its layout.

Each service runs in one transaction: it validates (field rules through ``full_clean``,
cross-row rules through ``fit``), saves, and records an audit event, so a refused request
leaves nothing behind. Bad input raises ``ValidationError({field: [message]})`` (HTTP 400), a
state conflict raises ``Conflict`` (409), deleting something still referenced raises
``ProtectedError`` (409); the helpers they share are ``federation.core.services``.
"""

from federation.inventory.services.deployments import (
    DEPLOYMENT_UPDATABLE,
    deployment_create,
    deployment_delete,
    deployment_update,
)
from federation.inventory.services.edges import edge_delete, edge_register, edge_update
from federation.inventory.services.instances import (
    instance_bring_up,
    instance_create,
    instance_delete,
    instance_drain,
    instance_transition,
    instance_undrain,
    instance_update,
)
from federation.inventory.services.language_models import (
    MODEL_UPDATABLE,
    adapter_create,
    adapter_delete,
    adapter_update,
    model_create,
    model_delete,
    model_update,
)
from federation.inventory.services.pools import (
    POOL_UPDATABLE,
    pool_cordon,
    pool_create,
    pool_delete,
    pool_uncordon,
    pool_update,
)
from federation.inventory.services.regions import (
    region_create,
    region_delete,
    region_evacuate,
    region_link_delete,
    region_link_set,
    region_link_update,
    region_restore,
    region_update,
)
from federation.inventory.services.reports import (
    edge_cold_demand_store,
    edge_report_store,
    instance_loads_store,
    region_recovery_record,
)

__all__ = [
    "DEPLOYMENT_UPDATABLE",
    "MODEL_UPDATABLE",
    "POOL_UPDATABLE",
    "adapter_create",
    "adapter_delete",
    "adapter_update",
    "deployment_create",
    "deployment_delete",
    "deployment_update",
    "edge_cold_demand_store",
    "edge_delete",
    "edge_register",
    "edge_report_store",
    "edge_update",
    "instance_bring_up",
    "instance_create",
    "instance_delete",
    "instance_drain",
    "instance_loads_store",
    "instance_transition",
    "instance_undrain",
    "instance_update",
    "model_create",
    "model_delete",
    "model_update",
    "pool_cordon",
    "pool_create",
    "pool_delete",
    "pool_uncordon",
    "pool_update",
    "region_create",
    "region_delete",
    "region_evacuate",
    "region_link_delete",
    "region_link_set",
    "region_link_update",
    "region_recovery_record",
    "region_restore",
    "region_update",
]
