"""Writes to base models and their LoRA adapters: a model change is rechecked against its
deployments."""

from __future__ import annotations

from collections.abc import Mapping
from decimal import Decimal
from typing import Any

from django.core.exceptions import NON_FIELD_ERRORS, ValidationError
from django.db import transaction

from federation.core.audit import Actor, audit_record
from federation.core.errors import Conflict
from federation.core.services import Errors, model_apply, model_lock, model_save, model_validate
from federation.inventory.models import Deployment, LanguageModel, LoraAdapter
from federation.inventory.services.fit_checks import (
    deployments_with_context,
    model_spec,
    recheck_deployments,
)

MODEL_UPDATABLE = (
    "name",
    "family",
    "parameter_count_b",
    "dtype",
    "weight_size_gib",
    "max_context_tokens",
    "num_layers",
    "num_attention_heads",
    "num_kv_heads",
    "head_dim",
)


def _model_errors(model: LanguageModel) -> Errors:
    heads, kv = model.num_attention_heads, model.num_kv_heads
    if isinstance(heads, int) and isinstance(kv, int) and kv >= 1 and heads >= 1:
        if kv > heads:
            return {"num_kv_heads": [f"num_kv_heads {kv} exceeds num_attention_heads {heads}."]}
        if heads % kv:
            return {
                "num_kv_heads": [
                    f"num_attention_heads {heads} must be a multiple of num_kv_heads {kv} "
                    f"(grouped-query attention)."
                ]
            }
    return {}


def _fields_valid(model: LanguageModel) -> bool:
    """Whether the model's own fields are valid: only then can the fit rules read them."""
    try:
        model.full_clean(validate_constraints=False)
    except ValidationError:
        return False
    return True


@transaction.atomic
def model_create(
    *,
    actor: Actor,
    name: str,
    family: str,
    parameter_count_b: Decimal,
    weight_size_gib: float,
    max_context_tokens: int,
    num_layers: int,
    num_attention_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: str = LanguageModel.DType.BF16,
) -> LanguageModel:
    model = LanguageModel(
        name=name,
        family=family,
        parameter_count_b=parameter_count_b,
        dtype=dtype,
        weight_size_gib=weight_size_gib,
        max_context_tokens=max_context_tokens,
        num_layers=num_layers,
        num_attention_heads=num_attention_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
    )
    model_validate(model, extra=_model_errors(model))
    model_save(model)
    audit_record(actor=actor, action="model.create", obj=model)
    return model


@transaction.atomic
def model_update(*, actor: Actor, model: LanguageModel, data: Mapping[str, Any]) -> LanguageModel:
    """Refuses a change that would break a deployment of the model (memory, heads vs TP)."""
    model = model_lock(model)
    before = model_spec(model)
    diff = model_apply(model, data, updatable=MODEL_UPDATABLE)
    errors = _model_errors(model)
    if not errors and _fields_valid(model):
        broken = recheck_deployments(
            deployments_with_context(Deployment.objects.filter(model=model)),
            before=(before, None),
            after=(model_spec(model), None),
        )
        if broken:
            errors[NON_FIELD_ERRORS] = broken
    model_validate(model, extra=errors)
    model_save(model)
    if diff:
        audit_record(actor=actor, action="model.update", obj=model, changes=diff)
    return model


@transaction.atomic
def model_delete(*, actor: Actor, model: LanguageModel) -> None:
    audit_record(actor=actor, action="model.delete", obj=model)
    model.delete()


@transaction.atomic
def adapter_create(
    *,
    actor: Actor,
    base_model: LanguageModel,
    name: str,
    rank: int,
    source: str,
    owner: Any | None = None,
) -> LoraAdapter:
    """``owner``: the tenant the adapter is private to (None: public)."""
    adapter = LoraAdapter(base_model=base_model, name=name, rank=rank, source=source, owner=owner)
    model_validate(adapter)
    model_save(adapter)
    audit_record(actor=actor, action="adapter.create", obj=adapter)
    return adapter


@transaction.atomic
def adapter_update(*, actor: Actor, adapter: LoraAdapter, data: Mapping[str, Any]) -> LoraAdapter:
    adapter = model_lock(adapter)
    diff = model_apply(adapter, data, updatable=("base_model", "name", "rank", "source", "owner"))
    errors: Errors = {}
    if "base_model" in diff:
        users = list(adapter.deployments.values_list("pk", flat=True))
        if users:
            errors["base_model"] = [
                f"adapter '{adapter.name}' is attached to deployments {users} of its current "
                f"base model; detach it before moving it to another model."
            ]
    model_validate(adapter, extra=errors)
    model_save(adapter)
    if diff:
        audit_record(actor=actor, action="adapter.update", obj=adapter, changes=diff)
    return adapter


@transaction.atomic
def adapter_delete(*, actor: Actor, adapter: LoraAdapter) -> None:
    """Refused while deployments serve the adapter (deleting would silently drop it there)."""
    users = list(adapter.deployments.values_list("pk", flat=True))
    if users:
        raise Conflict(
            f"Cannot delete adapter '{adapter.name}': deployments {users} serve it; detach it "
            f"first.",
            code="protected",
        )
    audit_record(actor=actor, action="adapter.delete", obj=adapter)
    adapter.delete()
