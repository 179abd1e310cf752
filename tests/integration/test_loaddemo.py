"""``fedinfer loaddemo`` builds the demo fleet through the services, and is idempotent."""

from __future__ import annotations

from decimal import Decimal
from io import StringIO

import pytest
from django.core.management import call_command

from federation.core.models import AuditEvent
from federation.inventory.models import Deployment, GPUPool, LanguageModel, LoraAdapter, Region
from federation.metering.models import ModelPrice
from federation.tenancy.models import ApiKey, Tenant


def _load() -> str:
    out = StringIO()
    call_command("loaddemo", stdout=out)
    return out.getvalue()


@pytest.mark.django_db
def test_loaddemo_builds_a_heterogeneous_fleet_and_is_idempotent() -> None:
    first = _load()
    assert "demo loaded: 48 new objects" in first
    assert set(Region.objects.values_list("jurisdiction", flat=True)) == {"US", "EU", "APAC"}
    accelerators = set(GPUPool.objects.values_list("accelerator__name", flat=True))
    assert {"H100-80G", "A100-80G", "L4-24G"} <= accelerators
    assert len(set(GPUPool.objects.values_list("price_per_gpu_hour", flat=True))) >= 4
    sizes = sorted(
        float(p) for p in LanguageModel.objects.values_list("parameter_count_b", flat=True)
    )
    assert sizes[0] < 10 and 30 < sizes[1] < 40 and sizes[2] > 60
    assert LoraAdapter.objects.count() == 2
    # The 70B model needs TP > 2, which the fit rules allow only on NVLink pools.
    for dep in Deployment.objects.filter(tensor_parallel_size__gt=2).select_related("pool"):
        assert dep.pool.interconnect == "nvlink"
    policies = {t.slug: t.allowed_jurisdictions for t in Tenant.objects.all()}
    assert policies["globex-eu"] == ["EU"] and policies["initech"] == []
    assert ApiKey.objects.filter(name="demo").count() == Tenant.objects.count()
    # List prices for every model, and Initech's own for the 8B one.
    assert ModelPrice.objects.filter(tenant=None).count() == LanguageModel.objects.count()
    assert ModelPrice.objects.get(tenant__slug="initech").output_per_mtok == Decimal("0.24")
    assert "(shown once): fi_" in first
    events = AuditEvent.objects.count()

    second = _load()
    assert "demo loaded: 0 new objects" in second
    assert "fi_" not in second  # no key is issued (or shown) twice
    assert AuditEvent.objects.count() == events
