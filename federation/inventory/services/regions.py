"""Writes to regions and the RTT matrix between them; evacuation drains and restore undrains
instances along their lifecycle."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from django.core.exceptions import ValidationError
from django.db import transaction
from django.utils import timezone

from federation.core.audit import Actor, audit_record
from federation.core.errors import Conflict
from federation.core.services import model_apply, model_lock, model_save, model_validate
from federation.inventory import lifecycle
from federation.inventory.models import Instance, Region, RegionLink
from federation.inventory.services.instances import locked_instance_transition

REGION_UPDATABLE = ("name", "provider", "latitude", "longitude", "jurisdiction", "status")


@transaction.atomic
def region_create(
    *,
    actor: Actor,
    code: str,
    name: str,
    provider: str,
    latitude: float,
    longitude: float,
    jurisdiction: str,
) -> Region:
    region = Region(
        code=code,
        name=name,
        provider=provider,
        latitude=latitude,
        longitude=longitude,
        jurisdiction=jurisdiction,
    )
    model_validate(region)
    model_save(region)
    audit_record(actor=actor, action="region.create", obj=region)
    return region


@transaction.atomic
def region_update(*, actor: Actor, region: Region, data: Mapping[str, Any]) -> Region:
    """Update fields; ``status`` may move between active and cordoned here, while evacuation
    has its own services because it also drains instances."""
    region = model_lock(region)
    new_status = data.get("status", region.status)
    if new_status != region.status and Region.Status.EVACUATED in (new_status, region.status):
        raise Conflict(
            "Use the evacuate and restore actions to move a region in or out of 'evacuated'.",
            code="use_action",
        )
    diff = model_apply(region, data, updatable=REGION_UPDATABLE)
    model_validate(region)
    model_save(region)
    if diff:
        audit_record(actor=actor, action="region.update", obj=region, changes=diff)
    return region


@transaction.atomic
def region_delete(*, actor: Actor, region: Region) -> None:
    """Refused while tenants restrict their residency to the region: dropping it from their
    allow-list would silently widen it to every region."""
    region = model_lock(region)
    tenants = list(region.tenants.values_list("slug", flat=True)[:10])
    if tenants:
        raise Conflict(
            f"Cannot delete region {region.code}: the residency policy of tenants "
            f"{', '.join(tenants)} names it.",
            code="protected",
        )
    audit_record(actor=actor, action="region.delete", obj=region)
    region.delete()


@transaction.atomic
def region_evacuate(*, actor: Actor, region: Region) -> Region:
    """Take a region out of traffic: mark it evacuated and drain its ready instances.
    Idempotent."""
    region = model_lock(region)
    if region.status == Region.Status.EVACUATED:
        return region
    old = region.status
    region.status = Region.Status.EVACUATED
    region.save(update_fields=["status", "updated_at"])
    drained = [
        locked_instance_transition(
            actor=actor,
            instance=inst,
            state=lifecycle.DRAINING,
            reason=Instance.DrainReason.EVACUATION,
        ).name
        for inst in Instance.objects.select_for_update()
        .filter(deployment__pool__region=region, state=lifecycle.READY)
        .order_by("pk")
    ]
    audit_record(
        actor=actor,
        action="region.evacuate",
        obj=region,
        changes={"status": [old, region.status], "drained_instances": drained},
    )
    return region


@transaction.atomic
def region_restore(*, actor: Actor, region: Region) -> Region:
    """Put a region back into traffic; undrain the instances its evacuation drained (those an
    operator drained stay drained). Its traffic returns gradually from ``restored_at`` (the
    routing compiler's ramp), not all at once. Idempotent."""
    region = model_lock(region)
    if region.status == Region.Status.ACTIVE:
        return region
    old = region.status
    region.status = Region.Status.ACTIVE
    fields = ["status", "updated_at"]
    if old == Region.Status.EVACUATED:
        # The routing compiler ramps its traffic back from now on (no flip back at once).
        region.restored_at = timezone.now()
        fields.append("restored_at")
    region.save(update_fields=fields)
    restored = [
        locked_instance_transition(actor=actor, instance=inst, state=lifecycle.READY).name
        for inst in Instance.objects.select_for_update()
        .filter(
            deployment__pool__region=region,
            state=lifecycle.DRAINING,
            drain_reason=Instance.DrainReason.EVACUATION,
        )
        .order_by("pk")
    ]
    audit_record(
        actor=actor,
        action="region.restore",
        obj=region,
        changes={"status": [old, region.status], "undrained_instances": restored},
    )
    return region


_UNSET: Any = object()


@transaction.atomic
def region_link_set(
    *,
    actor: Actor,
    source: Region,
    target: Region,
    rtt_ms: float,
    measured_rtt_ms: float | None = _UNSET,
) -> tuple[RegionLink, bool]:
    """Create or update the configured RTT from ``source`` to ``target``; True if created.
    ``measured_rtt_ms`` is kept unless given."""
    if source.pk == target.pk:
        raise ValidationError(
            {"target": ["A region has no link to itself; its RTT is zero by definition."]}
        )
    link = RegionLink.objects.select_for_update().filter(source=source, target=target).first()
    created = link is None
    if link is None:
        link = RegionLink(source=source, target=target)
    data: dict[str, Any] = {"rtt_ms": rtt_ms}
    if measured_rtt_ms is not _UNSET:
        data["measured_rtt_ms"] = measured_rtt_ms
    diff = model_apply(link, data, updatable=("rtt_ms", "measured_rtt_ms"))
    model_validate(link)
    model_save(link)
    if created:
        audit_record(actor=actor, action="region_link.create", obj=link, changes=diff)
    elif diff:
        audit_record(actor=actor, action="region_link.update", obj=link, changes=diff)
    return link, created


@transaction.atomic
def region_link_update(*, actor: Actor, link: RegionLink, data: Mapping[str, Any]) -> RegionLink:
    link = model_lock(link)
    diff = model_apply(link, data, updatable=("rtt_ms", "measured_rtt_ms"))
    model_validate(link)
    model_save(link)
    if diff:
        audit_record(actor=actor, action="region_link.update", obj=link, changes=diff)
    return link


@transaction.atomic
def region_link_delete(*, actor: Actor, link: RegionLink) -> None:
    audit_record(actor=actor, action="region_link.delete", obj=link)
    link.delete()
