"""Objects and credentials for the API fuzzer (tests/fuzz/run_schemathesis.sh).

``python -m tests.fuzz.seed fleet``: after ``fedinfer loaddemo``, the objects the demo leaves
out, so that every path parameter of the API names something real: one ready instance per
deployment (its engine URL unreachable: no worker runs, nothing probes it), one edge per region
(``fuzz-<region>``), a refused usage record in the dead-letter and the fuzzing admin; then
every region's routing table published (no worker runs to do it).

``python -m tests.fuzz.seed credentials``: JSON ``{"token", "edge", "region",
"edge_credential"}``, a fresh API token of the fuzzing admin and a new credential of
``FUZZ_EDGE`` (re-registered if the fuzzer deleted it). Management code, not the API: the
fuzzer may have logged the admin out, rotated the edge's credential or deleted the edge.
"""

from __future__ import annotations

import json
import os
import sys

FUZZ_USER = os.environ.get("FUZZ_USER", "fuzz-admin")
FUZZ_PASSWORD = "fuzz-admin-passphrase"
EDGE_PREFIX = "fuzz-"
#: The edge whose credential the fuzzer holds (usage and heartbeats are an edge's own).
FUZZ_EDGE = os.environ.get("FUZZ_EDGE", f"{EDGE_PREFIX}eu-west")


def unreachable_url(name: str) -> str:
    """Where a seeded engine or edge "listens": a host under ``.invalid`` (RFC 2606), which
    never resolves; no worker runs during fuzzing, so nothing probes it anyway."""
    return f"http://{name}.invalid:8000"


def _setup() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "federation.settings")
    import django

    django.setup()


def seed_fleet() -> list[str]:
    """Create the instances, edges and admin the demo has not (idempotent); their names."""
    from django.contrib.auth.models import User

    from federation.inventory import services as inventory
    from federation.inventory.models import Deployment, Edge, Instance, Region
    from federation.metering.models import UsageDeadLetter
    from federation.metering.services import DeadLetterIn, usage_dead_letters_add
    from federation.routing.services import routing_tables_publish
    from federation.tenancy.services import user_create

    # What the usage endpoint refuses (a time no clock converts), for the replay operation.
    refused = DeadLetterIn(
        source=UsageDeadLetter.Source.HTTP,
        edge=FUZZ_EDGE,
        region=FUZZ_EDGE.removeprefix(EDGE_PREFIX),
        document=b'[3,"0123456789ab-",1,1e18,"eu-west","eu-west","i-0","m",null,null,null,'
        b"0,0,0,null,0.0,200,false,false,true,null]",
        reason="started_at: not a time",
    )

    created: list[str] = []
    if not User.objects.filter(username=FUZZ_USER).exists():
        user_create(actor=None, username=FUZZ_USER, password=FUZZ_PASSWORD, role="admin")
        created.append(FUZZ_USER)
    for deployment in Deployment.objects.select_related("pool__region").order_by("pk"):
        name = f"fuzz-{deployment.pk}-0"
        if not Instance.objects.filter(name=name).exists():
            instance = inventory.instance_create(
                actor=None, deployment=deployment, name=name, endpoint_url=unreachable_url(name)
            )
            inventory.instance_bring_up(actor=None, instance=instance)
            created.append(name)
    for region in Region.objects.order_by("code"):
        name = f"{EDGE_PREFIX}{region.code}"
        if not Edge.objects.filter(name=name).exists():
            inventory.edge_register(actor=None, region=region, name=name, url=unreachable_url(name))
            created.append(name)
    # What the worker would have done: every region's table published, for the edges.
    routing_tables_publish()
    if not UsageDeadLetter.objects.exists():
        usage_dead_letters_add(letters=[refused])
        created.append("a usage dead letter")
    return created


def issue_credentials() -> dict[str, str]:
    """A new admin token and a new credential of ``FUZZ_EDGE``."""
    from django.contrib.auth.models import User

    from federation.inventory import services as inventory
    from federation.inventory.models import Edge, Region
    from federation.routing.services import edge_credential_rotate
    from federation.tenancy.services import auth_token_issue

    user = User.objects.get(username=FUZZ_USER)
    edge = Edge.objects.select_related("region").filter(name=FUZZ_EDGE).first()
    if edge is None:
        region = Region.objects.get(code=FUZZ_EDGE.removeprefix(EDGE_PREFIX))
        edge = inventory.edge_register(
            actor=None, region=region, name=FUZZ_EDGE, url=unreachable_url(FUZZ_EDGE)
        )
    return {
        "token": auth_token_issue(user=user).plaintext,
        "edge": edge.name,
        "region": edge.region.code,
        "edge_credential": edge_credential_rotate(actor=None, edge=edge),
    }


def main(argv: list[str]) -> int:
    if argv not in (["fleet"], ["credentials"]):
        print("usage: python -m tests.fuzz.seed fleet|credentials", file=sys.stderr)
        return 2
    _setup()
    if argv == ["fleet"]:
        from django.db import transaction

        with transaction.atomic():
            created = seed_fleet()
        print(f"seeded {len(created)} objects for the fuzzer")
    else:
        print(json.dumps(issue_credentials()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
