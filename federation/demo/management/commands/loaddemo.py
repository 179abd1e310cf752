"""``fedinfer loaddemo``: create the demo fleet, tenants and users. Idempotent.

Everything goes through the services, so the demo obeys the same validation (does the
deployment fit its pool?) and leaves the same audit trail as an operator would.
"""

from __future__ import annotations

from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

from django.contrib.auth.models import User
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import transaction

from federation.demo import fleet
from federation.env import is_production
from federation.inventory import services as inventory
from federation.inventory.models import (
    AcceleratorType,
    Deployment,
    GPUPool,
    LanguageModel,
    LoraAdapter,
    Region,
    RegionLink,
)
from federation.metering import services as metering
from federation.metering.models import ModelPrice
from federation.metering.pricing import Price
from federation.tenancy import services as tenancy
from federation.tenancy.models import ApiKey, Membership, Tenant

#: The demo's prices apply to everything it will ever meter.
PRICES_FROM = datetime(2026, 1, 1, tzinfo=UTC)


class Command(BaseCommand):
    help = "Create the demo inventory, tenants, users and one API key per tenant (idempotent)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--password",
            default=None,
            help=f"password of the demo users (default in embedded mode: {fleet.DEMO_PASSWORD!r})",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        password = options["password"]
        if password is None:
            if is_production():
                raise CommandError("In production, give the demo users a --password.")
            password = fleet.DEMO_PASSWORD
        with transaction.atomic():
            created = self._load(password)
        for line in created:
            self.stdout.write(line)
        self.stdout.write(self.style.SUCCESS(f"demo loaded: {len(created)} new objects"))

    def _load(self, password: str) -> list[str]:
        created: list[str] = []
        actor = None  # the system
        regions: dict[str, Region] = {}
        for spec in fleet.REGIONS:
            region = Region.objects.filter(code=spec["code"]).first()
            if region is None:
                region = inventory.region_create(actor=actor, **spec)
                created.append(f"region {region.code}")
            regions[region.code] = region
        for a, b, rtt in fleet.RTT_MS:
            for source, target in ((a, b), (b, a)):
                if not RegionLink.objects.filter(
                    source=regions[source], target=regions[target]
                ).exists():
                    inventory.region_link_set(
                        actor=actor, source=regions[source], target=regions[target], rtt_ms=rtt
                    )
                    created.append(f"rtt {source}->{target} {rtt} ms")
        pools: dict[tuple[str, str], GPUPool] = {}
        for spec in fleet.POOLS:
            fields = dict(spec)
            region = regions[fields.pop("region")]
            accelerator = AcceleratorType.objects.get(name=fields.pop("accelerator"))
            pool = GPUPool.objects.filter(region=region, name=fields["name"]).first()
            if pool is None:
                pool = inventory.pool_create(
                    actor=actor, region=region, accelerator=accelerator, **fields
                )
                created.append(f"pool {pool}")
            pools[(region.code, pool.name)] = pool
        models: dict[str, LanguageModel] = {}
        for spec in fleet.MODELS:
            model = LanguageModel.objects.filter(name=spec["name"]).first()
            if model is None:
                model = inventory.model_create(actor=actor, **spec)
                created.append(f"model {model.name}")
            models[model.name] = model
        adapters: dict[str, LoraAdapter] = {}
        for spec in fleet.ADAPTERS:
            fields = dict(spec)
            base = models[fields.pop("base_model")]
            adapter = LoraAdapter.objects.filter(name=fields["name"]).first()
            if adapter is None:
                adapter = inventory.adapter_create(actor=actor, base_model=base, **fields)
                created.append(f"adapter {adapter.name}")
            adapters[adapter.name] = adapter
        for region_code, pool_name, model_name, role, tp, lo, want, hi, names in fleet.DEPLOYMENTS:
            pool, model = pools[(region_code, pool_name)], models[model_name]
            if Deployment.objects.filter(pool=pool, model=model, role=role).exists():
                continue
            inventory.deployment_create(
                actor=actor,
                model=model,
                pool=pool,
                role=role,
                tensor_parallel_size=tp,
                min_replicas=lo,
                desired_replicas=want,
                max_replicas=hi,
                engine_args={"max-num-seqs": 128},
                adapters=[adapters[n] for n in names],
            )
            created.append(f"deployment {model_name} on {pool} ({role}, TP {tp} x {want})")
        for spec in fleet.TENANTS:
            fields = dict(spec)
            region_codes = fields.pop("allowed_regions", [])
            tenant = Tenant.objects.filter(slug=fields["slug"]).first()
            if tenant is None:
                tenant = tenancy.tenant_create(
                    actor=actor, allowed_regions=[regions[c] for c in region_codes], **fields
                )
                created.append(f"tenant {tenant.slug}")
            if not ApiKey.objects.filter(tenant=tenant, name="demo").exists():
                issued = tenancy.api_key_create(actor=actor, tenant=tenant, name="demo")
                created.append(f"api key of {tenant.slug} (shown once): {issued.plaintext}")
            created += self._user(
                f"{tenant.slug}-viewer", Membership.Role.TENANT_VIEWER, password, tenant
            )
        created += self._prices(actor, models)
        created += self._user("admin", Membership.Role.ADMIN, password, None)
        created += self._user("operator", Membership.Role.OPERATOR, password, None)
        return created

    def _prices(self, actor: Any, models: dict[str, LanguageModel]) -> list[str]:
        created = []
        for model_name, slug, fresh, cached, output in fleet.PRICES:
            model = models[model_name]
            tenant = Tenant.objects.get(slug=slug) if slug else None
            if ModelPrice.objects.filter(model=model, tenant=tenant).exists():
                continue
            metering.model_price_set(
                actor=actor,
                model=model,
                tenant=tenant,
                price=Price(Decimal(fresh), Decimal(cached), Decimal(output)),
                effective_from=PRICES_FROM,
            )
            created.append(f"price of {model_name} for {slug or 'everyone'}")
        return created

    def _user(self, username: str, role: str, password: str, tenant: Tenant | None) -> list[str]:
        if User.objects.filter(username=username).exists():
            return []
        tenancy.user_create(
            actor=None, username=username, password=password, role=role, tenant=tenant
        )
        return [f"user {username} ({role}) password {password!r}"]
