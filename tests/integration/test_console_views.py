"""The console through Django's test client: every page's roles, the actions through the
services (audited, previewed first), bad input answered with clear messages and nothing
written, and query counts that do not grow with the rows listed."""

from __future__ import annotations

import csv
import io
import re
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from federation.api.throttles import login_cache
from federation.core.audit import audit_record
from federation.core.models import AuditEvent
from federation.inventory.models import Edge, GPUPool, Instance, Region
from federation.routing.models import RoutingTableVersion
from federation.routing.services import routing_tables_publish
from federation.telemetry.heartbeats import InstanceReport, edge_heartbeat_record
from federation.tenancy import services as tenancy
from federation.tenancy.keys import hash_key
from federation.tenancy.models import ApiKey, Tenant
from tests.integration.console_support import PASSWORD, demo_fleet

pytestmark = pytest.mark.django_db


@pytest.fixture
def fleet() -> None:
    demo_fleet(usage_days=2)


def login(username: str) -> Client:
    client = Client()
    client.force_login(User.objects.get(username=username))
    return client


@pytest.fixture
def operator(fleet: None) -> Client:
    return login("operator")


@pytest.fixture
def admin(fleet: None) -> Client:
    return login("admin")


@pytest.fixture
def viewer(fleet: None) -> Client:
    return login("globex-eu-viewer")


def a_ready_instance(region: str = "us-east") -> Instance:
    return Instance.objects.filter(deployment__pool__region__code=region, state="ready").first()


def staff_pages() -> list[str]:
    inst = a_ready_instance()
    pool = GPUPool.objects.get(region__code="eu-west", name="a100-pcie")
    return [
        reverse("console:overview"),
        reverse("console:regions"),
        reverse("console:region", args=["us-east"]),
        reverse("console:region-evacuate", args=["eu-west"]),
        reverse("console:region-evacuate", args=["eu-west"]) + "?preview=1",
        reverse("console:region-restore", args=["eu-west"]),
        reverse("console:pool-cordon", args=[pool.pk]),
        reverse("console:pool-uncordon", args=[pool.pk]),
        reverse("console:instance-drain", args=[inst.name]),
        reverse("console:instance-undrain", args=[inst.name]),
        reverse("console:models"),
        reverse("console:routing"),
        reverse("console:routing-table", args=["us-east"]),
        reverse("console:routing-diff", args=["us-east"]),
        reverse("console:inspect"),
        reverse("console:costs"),
        reverse("console:audit"),
        reverse("console:key-create", args=["acme-us"]),
        reverse("console:key-revoke", args=[ApiKey.objects.get(tenant__slug="acme-us").pk]),
        reverse("console:key-rotate", args=[ApiKey.objects.get(tenant__slug="acme-us").pk]),
    ]


# --- who may see what ----------------------------------------------------------------------


def test_anonymous_visitors_are_sent_to_the_login_page(fleet: None) -> None:
    client = Client()
    for url in [*staff_pages(), reverse("console:tenants"), reverse("console:usage")]:
        response = client.get(url)
        assert response.status_code == 302, url
        assert response["Location"].startswith(reverse("console:login") + "?next="), url
    assert client.get("/").status_code == 302


@pytest.mark.parametrize("username", ["operator", "admin"])
def test_staff_open_every_page(fleet: None, username: str) -> None:
    client = login(username)
    for url in [*staff_pages(), reverse("console:tenants"), reverse("console:usage")]:
        assert client.get(url).status_code == 200, url
    assert client.get(reverse("console:tenant", args=["globex-eu"])).status_code == 200
    assert client.get(reverse("console:home")).url == reverse("console:overview")


def test_a_tenant_viewer_sees_its_own_tenant_only(viewer: Client) -> None:
    for url in staff_pages():
        response = viewer.get(url)
        assert response.status_code == 403, url
        assert b"Your role does not allow this." in response.content
    assert viewer.get(reverse("console:home")).url == reverse("console:tenant", args=["globex-eu"])
    own = viewer.get(reverse("console:tenant", args=["globex-eu"]))
    assert own.status_code == 200
    assert b"New key" not in own.content  # read-only: keys listed, no actions
    assert viewer.get(reverse("console:tenant", args=["acme-us"])).status_code == 404
    listed = viewer.get(reverse("console:tenants"))
    assert b"globex-eu" in listed.content and b"acme-us" not in listed.content
    # Actions on its own tenant's keys are not for its role, nor on another's.
    own_key = ApiKey.objects.get(tenant__slug="globex-eu")
    other_key = ApiKey.objects.get(tenant__slug="acme-us")
    for key in (own_key, other_key):
        assert viewer.post(reverse("console:key-revoke", args=[key.pk])).status_code == 403
        assert viewer.post(reverse("console:key-rotate", args=[key.pk])).status_code == 403
    assert viewer.post(reverse("console:key-create", args=["globex-eu"])).status_code == 403
    assert ApiKey.objects.filter(revoked_at__isnull=False).count() == 0
    assert ApiKey.objects.count() == Tenant.objects.count()


def test_a_tenant_viewers_usage_is_its_own_whatever_it_asks(viewer: Client) -> None:
    url = reverse("console:usage")
    query = "start=2000-01-01&end=2000-01-02&bucket=day&group_by=tenant&metric=price_usd"
    assert viewer.get(f"{url}?{query}").status_code == 200
    response = viewer.get(f"{url}?{_last_days()}&group_by=tenant&tenant=acme-us&output=csv")
    rows = list(csv.DictReader(io.StringIO(response.content.decode())))
    assert rows and {r["tenant"] for r in rows} == {"globex-eu"}
    assert "cost_usd" not in rows[0]  # the operator's cost is not the tenant's business
    assert viewer.get(reverse("console:costs")).status_code == 403


def test_users_are_for_admins_not_operators(admin: Client) -> None:
    assert admin.get(reverse("console:users")).status_code == 200
    assert login("operator").get(reverse("console:users")).status_code == 403


# --- login ---------------------------------------------------------------------------------


def test_login_and_logout(fleet: None) -> None:
    client = Client()
    bad = client.post(reverse("console:login"), {"username": "operator", "password": "nope"})
    assert bad.status_code == 200
    assert b"Please enter a correct username and password" in bad.content
    good = client.post(reverse("console:login"), {"username": "operator", "password": PASSWORD})
    assert good.status_code == 302 and good.url == reverse("console:home")
    assert client.get(reverse("console:overview")).status_code == 200
    assert client.post(reverse("console:logout")).status_code == 302
    assert client.get(reverse("console:overview")).status_code == 302


def test_login_form_is_throttled_like_the_api(fleet: None, settings: Any) -> None:
    settings.FEDINFER_LOGIN_RATE = "3/min"
    login_cache.local.clear()
    client = Client(REMOTE_ADDR="10.9.9.9")
    codes = [
        client.post(reverse("console:login"), {"username": "x", "password": "y"}).status_code
        for _ in range(4)
    ]
    assert codes == [200, 200, 200, 429]


# --- actions -------------------------------------------------------------------------------


def test_drain_shows_its_preview_then_drains_through_the_service(operator: Client) -> None:
    inst = a_ready_instance("ap-southeast")
    url = reverse("console:instance-drain", args=[inst.name])
    assert "What will happen" in operator.get(url).content.decode()
    page = operator.get(url, {"preview": "1"}).content.decode()  # fetched by htmx
    assert f"Stop receiving traffic: {inst.name}" in page
    response = operator.post(url)
    assert response.status_code == 302
    inst.refresh_from_db()
    assert inst.state == "draining" and inst.drain_reason == "operator"
    event = AuditEvent.objects.filter(action="instance.transition", object_id=str(inst.pk)).first()
    assert event is not None and event.actor_repr == "operator"
    followed = operator.get(response.url).content.decode()
    assert f"Instance {inst.name} is draining." in followed


def test_evacuation_preview_names_who_moves_and_who_is_refused(operator: Client) -> None:
    url = reverse("console:region-evacuate", args=["eu-west"])
    page = operator.get(url, {"preview": "1"}).content.decode()
    # globex-eu may only be served in the EU: evacuating eu-west leaves it nowhere to go.
    assert "globex-eu" in page and "refused" in page
    assert "become refused" in page
    # initech may go anywhere: it moves to another region.
    assert "initech" in page
    assert Region.objects.get(code="eu-west").status == "active"  # GET changes nothing
    operator.post(url)
    assert Region.objects.get(code="eu-west").status == "evacuated"
    assert not Instance.objects.filter(deployment__pool__region__code="eu-west", state="ready")
    restore = reverse("console:region-restore", args=["eu-west"])
    assert "Start receiving traffic" in operator.get(restore, {"preview": "1"}).content.decode()
    operator.post(restore)
    assert Region.objects.get(code="eu-west").status == "active"
    # Its traffic comes back in steps: the overview shows where the ramp stands.
    overview = operator.get(reverse("console:overview")).content.decode()
    assert "Coming back" in overview and "20 % of its traffic" in overview


def _heartbeat(inst: Instance, in_flight: int, *, at: datetime | None = None) -> None:
    """The region's edge reports ``inst`` (the service behind ``/api/v1/edges/heartbeat``)."""
    edge = Edge.objects.get(region=inst.deployment.pool.region)
    report = InstanceReport(inst.name, True, {"in_flight": in_flight, "tokens_per_s": 10.0})
    edge_heartbeat_record(edge=edge, applied_table_version=None, instances=[report], at=at)


def _instances_fragment(client: Client, region: str) -> str:
    """The live instance table, as the page's htmx poll fetches it."""
    url = reverse("console:region", args=[region])
    return client.get(url, headers={"HX-Request": "true"}).content.decode()


def test_a_drain_shows_the_requests_it_still_has_in_flight(operator: Client) -> None:
    inst = a_ready_instance()
    assert "in flight to finish" not in _instances_fragment(operator, "us-east")
    operator.post(reverse("console:instance-drain", args=[inst.name]))
    assert "requests in flight unknown (no fresh heartbeat)" in _instances_fragment(
        operator, "us-east"
    )
    _heartbeat(inst, 3)
    assert "3 requests in flight to finish" in _instances_fragment(operator, "us-east")
    _heartbeat(inst, 1)
    assert "1 request in flight to finish" in _instances_fragment(operator, "us-east")
    _heartbeat(inst, 0)
    row = _instances_fragment(operator, "us-east").split(f'id="instance-{inst.name}"')[1]
    assert "drained: nothing in flight" in row.split("</tr>")[0]
    # A report older than the heartbeat window is not taken for the present.
    Instance.objects.filter(pk=inst.pk).update(
        load={"in_flight": 0, "reported_at": (timezone.now() - timedelta(minutes=2)).isoformat()}
    )
    assert "in flight unknown (no fresh heartbeat)" in _instances_fragment(operator, "us-east")


def test_scale_down_drains_and_warming_show_their_time_against_the_timeouts(
    operator: Client, settings: Any
) -> None:
    settings.FEDINFER_FLEET_WARMING_TIMEOUT_SECONDS = 300
    settings.FEDINFER_FLEET_DRAIN_TIMEOUT_SECONDS = 60
    draining, warming = Instance.objects.filter(
        deployment__pool__region__code="us-east", state="ready"
    ).order_by("name")[:2]
    now = timezone.now()
    Instance.objects.filter(pk=draining.pk).update(
        state="draining", drain_reason="scale_down", state_changed_at=now - timedelta(seconds=15)
    )
    Instance.objects.filter(pk=warming.pk).update(
        state="warming", state_changed_at=now - timedelta(seconds=100)
    )
    _heartbeat(draining, 2)
    page = _instances_fragment(operator, "us-east")
    drain_row = page.split(f'id="instance-{draining.name}"')[1].split("</tr>")[0]
    assert "2 requests in flight to finish; stopped when idle, or after 1 min 00 s" in drain_row
    assert re.search(r'<progress value="1[5-9]" max="60"', drain_row)
    warm_row = page.split(f'id="instance-{warming.name}"')[1].split("</tr>")[0]
    assert "warming for 1 min 4" in warm_row and "of the 5 min 00 s allowed" in warm_row
    assert re.search(r'<progress value="1\d\d" max="300"', warm_row)


def test_a_restored_region_shows_its_ramp_against_the_schedule(
    operator: Client, settings: Any
) -> None:
    settings.FEDINFER_RAMP_SECONDS = 120
    settings.FEDINFER_RAMP_STEPS = 4
    assert 'id="region-ramp"' not in _instances_fragment(operator, "eu-west")
    operator.post(reverse("console:region-evacuate", args=["eu-west"]))
    operator.post(reverse("console:region-restore", args=["eu-west"]))
    ramp = _instances_fragment(operator, "eu-west").split('id="region-ramp"')[1].split("</div>")[0]
    assert "ramping back: 20 % of its traffic, step 1 of 4, next step in" in ramp
    assert re.search(r'<progress value="\d+" max="120"', ramp)
    # Halfway through the window: step 3 of 4 (60 %), on the region page and the overview.
    Region.objects.filter(code="eu-west").update(restored_at=timezone.now() - timedelta(seconds=65))
    assert "60 % of its traffic, step 3 of 4" in _instances_fragment(operator, "eu-west")
    overview = operator.get(reverse("console:overview"), headers={"HX-Request": "true"})
    assert "60 % of its traffic, step 3 of 4" in overview.content.decode()
    # Once the window has passed there is no ramp to show.
    Region.objects.filter(code="eu-west").update(restored_at=timezone.now() - timedelta(hours=1))
    assert 'id="region-ramp"' not in _instances_fragment(operator, "eu-west")


def test_models_page_shows_scaling_and_failover_history(operator: Client) -> None:
    inst = a_ready_instance("ap-southeast")
    operator.post(reverse("console:instance-drain", args=[inst.name]))
    operator.post(reverse("console:region-evacuate", args=["eu-west"]))
    region = Region.objects.get(code="eu-west")
    # What the fleet worker records when it fails a region over on its own.
    audit_record(actor=None, action="fleet.region_restore", obj=region, changes={"reason": "up"})
    audit_record(actor=None, action="region.update", obj=region, changes={"name": ["a", "b"]})
    page = operator.get(reverse("console:models"))
    actions = [e.action for e in page.context["history"]]
    assert {"instance.transition", "region.evacuate", "fleet.region_restore"} <= set(actions)
    assert "region.update" not in actions  # an edit of a region is not failover
    assert actions[0] == "fleet.region_restore"  # newest first
    history = page.content.decode().split('id="history"')[1]
    assert "Scaling and failover history" in history and "eu-west" in history


def test_cordon_preview_says_routing_does_not_change(operator: Client) -> None:
    pool = GPUPool.objects.get(region__code="eu-west", name="a100-pcie")
    url = reverse("console:pool-cordon", args=[pool.pk])
    assert "No routing change" in operator.get(url, {"preview": "1"}).content.decode()
    operator.post(url)
    pool.refresh_from_db()
    assert pool.status == "cordoned"


def test_a_refused_action_says_why(operator: Client) -> None:
    inst = Instance.objects.filter(state="ready").first()
    Instance.objects.filter(pk=inst.pk).update(state="stopped")
    response = operator.post(reverse("console:instance-drain", args=[inst.name]), follow=True)
    assert "stopped" in response.content.decode() and "draining" in response.content.decode()
    inst.refresh_from_db()
    assert inst.state == "stopped"


def test_actions_take_get_and_post_only(operator: Client) -> None:
    url = reverse("console:region-evacuate", args=["eu-west"])
    assert operator.put(url).status_code == 405
    assert operator.delete(url).status_code == 405


# --- keys ----------------------------------------------------------------------------------


def test_create_a_key_and_see_its_secret_once(operator: Client) -> None:
    url = reverse("console:key-create", args=["acme-us"])
    response = operator.post(url, {"name": "ci", "scopes": ["inference"]})
    assert response.status_code == 200 and response["Cache-Control"] == "no-store"
    secret = response.context["plaintext"]
    assert secret.startswith("fi_") and secret in response.content.decode()
    key = ApiKey.objects.get(tenant__slug="acme-us", name="ci")
    assert key.key_hash == hash_key(secret)
    tenant_page = operator.get(reverse("console:tenant", args=["acme-us"])).content.decode()
    assert key.prefix in tenant_page and secret not in tenant_page


@pytest.mark.parametrize(
    ("data", "field", "message"),
    [
        ({"name": "", "scopes": ["inference"]}, "name", "This field is required."),
        ({"name": "x"}, "scopes", "This field is required."),
        ({"name": "x", "scopes": ["admin"]}, "scopes", "Select a valid choice."),
        (
            {"name": "x", "scopes": ["inference"], "expires_at": "2001-01-01T00:00"},
            "expires_at",
            "Must be in the future.",
        ),
        ({"name": "x" * 101, "scopes": ["inference"]}, "name", "at most 100 characters"),
    ],
)
def test_bad_key_input_is_explained_and_writes_nothing(
    operator: Client, data: dict[str, Any], field: str, message: str
) -> None:
    before = (ApiKey.objects.count(), AuditEvent.objects.count())
    response = operator.post(reverse("console:key-create", args=["acme-us"]), data)
    assert response.status_code == 200
    assert any(message in e for e in response.context["form"].errors[field])
    assert message.split(" at most")[0] in response.content.decode()
    assert (ApiKey.objects.count(), AuditEvent.objects.count()) == before


def test_a_key_of_an_inactive_tenant_is_refused_with_the_reason(operator: Client) -> None:
    tenancy.tenant_deactivate(actor=None, tenant=Tenant.objects.get(slug="acme-us"))
    before = ApiKey.objects.count()
    response = operator.post(
        reverse("console:key-create", args=["acme-us"]), {"name": "x", "scopes": ["inference"]}
    )
    assert "acme-us is inactive" in response.content.decode()
    assert ApiKey.objects.count() == before


def test_rotate_and_revoke(operator: Client) -> None:
    key = ApiKey.objects.get(tenant__slug="initech")
    rotate = reverse("console:key-rotate", args=[key.pk])
    bad = operator.post(rotate, {"grace_seconds": "-1"})
    assert "greater than or equal to 0" in bad.content.decode()
    old_hash = key.key_hash
    key.refresh_from_db()
    assert key.key_hash == old_hash
    done = operator.post(rotate, {"grace_seconds": "60"})
    key.refresh_from_db()
    assert key.key_hash == hash_key(done.context["plaintext"]) != old_hash
    revoke = reverse("console:key-revoke", args=[key.pk])
    assert operator.post(revoke).status_code == 302
    key.refresh_from_db()
    assert key.revoked_at is not None
    again = operator.post(revoke, follow=True).content.decode()
    assert "already revoked" in again


# --- reports -------------------------------------------------------------------------------


def _last_days(days: int = 3) -> str:
    today = timezone.now().date()
    return f"start={today - timedelta(days=days)}&end={today}&bucket=day&metric=price_usd"


def test_usage_chart_and_csv_agree(operator: Client) -> None:
    url = f"{reverse('console:usage')}?{_last_days()}&group_by=region"
    page = operator.get(url)
    chart = page.context["chart"]
    assert chart["x"] and {s["label"] for s in chart["series"]} <= {
        "us-east",
        "eu-west",
        "ap-southeast",
    }
    response = operator.get(url + "&output=csv")
    assert response["Content-Type"].startswith("text/csv")
    rows = list(csv.DictReader(io.StringIO(response.content.decode())))
    assert {"day", "region", "requests", "price_usd", "cost_usd", "margin_usd"} <= set(rows[0])
    total_csv = sum(float(r["price_usd"]) for r in rows)
    total_chart = sum(sum(s["values"]) for s in chart["series"])
    # The chart rounds each point to a millionth; the CSV has the exact decimals.
    assert total_csv == pytest.approx(total_chart, abs=1e-6 * len(rows))


@pytest.mark.parametrize(
    ("query", "message"),
    [
        ("start=2026-02-01&end=2026-01-01&bucket=day", "must not be before the start"),
        ("start=2025-01-01&end=2026-06-01&bucket=day", "at most 400 days"),
        ("start=2026-01-01&end=2026-03-01&bucket=hour", "at most 31 days"),
        ("start=yesterday&end=2026-01-01&bucket=day", "Enter a valid date."),
        ("start=2026-01-01&end=2026-01-02&bucket=week", "Select a valid choice."),
    ],
)
def test_bad_report_ranges_are_explained(operator: Client, query: str, message: str) -> None:
    for name in ("console:usage", "console:costs"):
        response = operator.get(f"{reverse(name)}?{query}&group_by=model&metric=requests")
        assert response.status_code == 200
        assert message in response.content.decode(), name
        assert "chart" not in response.context or response.context["chart"] is None


def test_pool_costs_csv(operator: Client) -> None:
    response = operator.get(f"{reverse('console:costs')}?{_last_days()}&output=csv")
    rows = list(csv.DictReader(io.StringIO(response.content.decode())))
    assert rows and {"day", "pool", "cost_usd", "idle_usd", "reprefill_usd"} <= set(rows[0])


# --- routing -------------------------------------------------------------------------------


def test_routing_table_and_diff(operator: Client) -> None:
    region = Region.objects.get(code="us-east")
    latest = RoutingTableVersion.objects.filter(region=region).order_by("-version").first()
    page = operator.get(reverse("console:routing-table", args=["us-east"])).content.decode()
    assert f"v{latest.version}" in page and "acme-us" in page
    operator.post(reverse("console:instance-drain", args=[a_ready_instance("us-east").name]))
    routing_tables_publish(regions=["us-east"])
    newer = RoutingTableVersion.objects.filter(region=region).order_by("-version").first()
    assert newer.version == latest.version + 1
    diff = operator.get(reverse("console:routing-diff", args=["us-east"]))
    assert diff.context["diff"]
    assert "\N{MINUS SIGN} us-east-" in diff.content.decode()  # the drained instance left
    missing = operator.get(reverse("console:routing-diff", args=["us-east"]) + "?old=1&new=999")
    assert "us-east has no version 999." in missing.content.decode()
    assert (
        operator.get(reverse("console:routing-table", args=["us-east"]) + "?v=999").status_code
        == 404
    )
    assert operator.get(reverse("console:routing-table", args=["nowhere"])).status_code == 404


def test_inspector_explains_local_residency_and_refusal(operator: Client) -> None:
    url = reverse("console:inspect")
    llama = "meta-llama/Llama-3.1-8B-Instruct"
    local = operator.get(url, {"tenant": "initech", "model": llama, "origin": "us-east"})
    assert local.context["decision"].region == "us-east"
    assert local.context["decision"].reason == "local"
    moved = operator.get(url, {"tenant": "globex-eu", "model": llama, "origin": "us-east"})
    assert moved.context["decision"].region == "eu-west"
    assert moved.context["decision"].reason == "residency"
    Region.objects.filter(code="eu-west").update(status="evacuated")
    routing_tables_publish()
    refused = operator.get(url, {"tenant": "globex-eu", "model": llama, "origin": "us-east"})
    assert refused.context["decision"].region is None
    assert "Refused" in refused.content.decode()
    unknown = operator.get(url, {"tenant": "nobody", "model": llama, "origin": "us-east"})
    assert unknown.context["form"].errors["tenant"] == ["No tenant 'nobody'."]
    assert "No tenant &#x27;nobody&#x27;." in unknown.content.decode()
    bad_model = operator.get(url, {"tenant": "initech", "model": "gpt-9", "origin": "us-east"})
    assert "Select a valid choice." in bad_model.content.decode()


# --- audit ---------------------------------------------------------------------------------


def test_audit_log_filters(operator: Client) -> None:
    operator.post(reverse("console:pool-cordon", args=[GPUPool.objects.first().pk]))
    url = reverse("console:audit")
    page = operator.get(url, {"action": "pool.cordon"})
    events = list(page.context["page"])
    assert events and all(e.action == "pool.cordon" for e in events)
    assert events[0].actor_repr == "operator"
    assert not list(operator.get(url, {"actor": "nobody"}).context["page"])
    bad = operator.get(url, {"since": "2026-02-01", "until": "2026-01-01"})
    assert "must not be before the first" in bad.content.decode()


# --- query counts --------------------------------------------------------------------------


def _more_rows() -> None:
    """More tenants, keys, events and instances, so that N+1 queries would show."""
    for i in range(30):
        tenant = tenancy.tenant_create(actor=None, slug=f"extra-{i:02d}", name=f"Extra {i}")
        tenancy.api_key_create(actor=None, tenant=tenant, name="k")
    acme = Tenant.objects.get(slug="acme-us")
    for i in range(10):
        tenancy.api_key_create(actor=None, tenant=acme, name=f"k{i}")


@pytest.mark.parametrize(
    ("name", "args", "most"),
    [
        ("console:overview", [], 12),
        ("console:regions", [], 10),
        ("console:region", ["us-east"], 12),
        ("console:models", [], 12),
        ("console:routing", [], 10),
        ("console:tenants", [], 12),
        ("console:tenant", ["acme-us"], 14),
        ("console:audit", [], 10),
        ("console:users", [], 8),
    ],
)
def test_lists_cost_a_bounded_number_of_queries(
    admin: Client,
    django_assert_max_num_queries: Callable[..., Any],
    name: str,
    args: list[str],
    most: int,
) -> None:
    _more_rows()
    url = reverse(name, args=args)
    admin.get(url)  # warm up: sessions, content types
    with django_assert_max_num_queries(most):
        assert admin.get(url).status_code == 200


def test_usage_by_tenant_charts_the_biggest_and_sums_the_rest(operator: Client) -> None:
    url = f"{reverse('console:usage')}?{_last_days()}&group_by=tenant&metric=cached_tokens"
    page = operator.get(url)
    chart, totals = page.context["chart"], page.context["totals"]
    assert [r["tenant"] for r in totals][:1] == [chart["series"][0]["label"]]
    assert [r["cached_tokens"] for r in totals] == sorted(
        (r["cached_tokens"] for r in totals), reverse=True
    )
    csv_rows = list(csv.DictReader(io.StringIO(operator.get(url + "&output=csv").content.decode())))
    assert sum(int(r["cached_tokens"]) for r in csv_rows) == sum(
        sum(s["values"]) for s in chart["series"]
    )


def test_the_region_page_shows_how_many_workers_each_edge_runs(operator: Client) -> None:
    edge = Edge.objects.filter(region__code="eu-west").first()
    assert edge is not None
    Edge.objects.filter(pk=edge.pk).update(workers=4)
    page = operator.get(reverse("console:region", args=["eu-west"])).content.decode()
    row = page.split(f"<tr><td>{edge.name}</td>")[1].split("</tr>")[0]
    assert f"<td>{edge.url}</td><td>4</td>" in row
