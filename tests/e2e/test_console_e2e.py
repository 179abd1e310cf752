"""The console in a real browser against a real control plane on loopback.

Real PostgreSQL (committed rows: the subprocesses read them), Redis DB 4 for the broker and
the table nudges, ``fedinfer serve``, ``fedinfer worker`` (it publishes the tables after the
evacuation, as in production) and one ``fedinfer edge`` in control-plane mode for eu-west (its
heartbeats report the table version it applied). Headless Chromium logs in as an operator,
finds a region, drains an instance and watches it change and its requests in flight run out
(us-east's edge reporting them), previews then evacuates a region and sees the new table
version reach its edge, creates a key and sees the secret once, reads a cost chart and exports
it as CSV; a tenant viewer is refused another tenant's pages and actions.
Screenshots go to ``var/screenshots/``.
"""

from __future__ import annotations

import csv
import io
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from django.contrib.auth.models import User
from playwright.sync_api import Browser, Page, expect

from federation.inventory import services as inventory
from federation.inventory.models import Edge, Instance, Region
from federation.routing import services as routing
from federation.routing.models import RoutingTableVersion
from federation.telemetry import heartbeats
from federation.tenancy.models import ApiKey
from regions.supervisor import Supervisor, free_port, wait_until
from tests.e2e.conftest import ASYNC_UNSAFE, SCREENSHOTS
from tests.integration.console_support import PASSWORD, demo_fleet
from tests.integration.control_plane_support import (
    FEDINFER,
    own_redis,
    serve,
    start_control_plane_edge,
    subprocess_env,
    write_table_keys,
)

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

REDIS_URL = os.environ["REDIS_URL"]  # this test worker's own (tests/isolation.py)
EXPECT_MS = 30_000


@pytest.fixture(autouse=True)
def redis_4(settings: Any) -> Iterator[None]:
    with own_redis(settings, REDIS_URL):
        yield


#: Page -> what the browser refused under the Content-Security-Policy, across navigations.
CSP_VIOLATIONS: dict[Page, list[str]] = {}
#: Runs before the page's own scripts (Playwright injects it, the page's CSP does not apply).
REPORT_VIOLATIONS = """
document.addEventListener("securitypolicyviolation", (e) => window.reportCspViolation(
  `${e.violatedDirective} ${e.blockedURI} ${e.sourceFile}:${e.lineNumber}`));
"""


def watch_csp(page: Page) -> list[str]:
    """Collect the page's CSP violations: the DOM event, and Chromium's "Refused to …"."""
    seen: list[str] = []
    page.expose_binding("reportCspViolation", lambda _source, what: seen.append(what))
    page.add_init_script(REPORT_VIOLATIONS)
    page.on(
        "console",
        lambda msg: (
            seen.append(msg.text)
            if "Content Security Policy" in msg.text or "Refused to" in msg.text
            else None
        ),
    )
    CSP_VIOLATIONS[page] = seen
    return seen


def log_in(browser: Browser, base: str, username: str) -> Page:
    page = browser.new_context(
        viewport={"width": 1366, "height": 860}, accept_downloads=True
    ).new_page()
    page.set_default_timeout(EXPECT_MS)
    watch_csp(page)
    page.goto(base + "/")
    expect(page).to_have_url(re.compile(r"/console/login/\?next="))
    page.get_by_label("Username").fill(username)
    page.get_by_label("Password").fill(PASSWORD)
    page.get_by_role("button", name="Log in").click()
    return page


def nav(page: Page, name: str) -> None:
    page.get_by_role("navigation", name="Main").get_by_role("link", name=name).click()


def shot(page: Page, name: str) -> None:
    page.screenshot(path=str(SCREENSHOTS / f"console-{name}.png"), full_page=True)


def latest_version(code: str) -> int:
    return (
        RoutingTableVersion.objects.filter(region__code=code)
        .order_by("-version")
        .values_list("version", flat=True)
        .first()
        or 0
    )


@pytest.mark.slow
def test_console_end_to_end(procs: Supervisor, browser: Browser, settings: Any) -> None:
    demo_fleet(usage_days=3, edges=False)
    # The test settings hash with MD5 (fast); the server checks with the production hashers.
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.PBKDF2PasswordHasher"]
    for user in User.objects.filter(username__in=["operator", "globex-eu-viewer"]):
        user.set_password(PASSWORD)
        user.save(update_fields=["password"])
    # Every region has an edge registered (the tables route between them); eu-west's runs.
    ports = {r.code: free_port() for r in Region.objects.all()}
    edges = {
        r.code: inventory.edge_register(
            actor=None, region=r, name=f"edge-{r.code}", url=f"http://127.0.0.1:{ports[r.code]}"
        )
        for r in Region.objects.all()
    }
    edge, edge_port, ops_port = edges["eu-west"], ports["eu-west"], free_port()
    credential = routing.edge_credential_rotate(actor=None, edge=edge)
    routing.routing_tables_publish()

    env = subprocess_env(REDIS_URL)
    env.pop(ASYNC_UNSAFE)
    # As deployed: without debug pages (Django's technical 404 carries an inline <style>, which
    # the policy refuses; production refuses FEDINFER_DEBUG anyway).
    env["FEDINFER_DEBUG"] = "false"
    base, _ = serve(procs, env)
    worker = [FEDINFER, "worker", "--pool", "solo", "--without-gossip", "--without-mingle"]
    procs.start("worker", worker, env=env)
    edge_proc = start_control_plane_edge(
        procs,
        region="eu-west",
        control_plane=base,
        credential=credential,
        table_keys=write_table_keys(procs.log_dir / "table-keys"),
        port=edge_port,
        ops_port=ops_port,
        env=env,
    )
    applied = lambda: Edge.objects.get(pk=edge.pk).applied_table_version  # noqa: E731
    wait_until(
        lambda: applied() == latest_version("eu-west"), what="edge heartbeat", watch=edge_proc
    )

    # 1. Log in; the overview shows every region and the edge on the latest table.
    page = log_in(browser, base, "operator")
    expect(page).to_have_url(base + "/console/overview/")
    expect(page.get_by_role("heading", name="ap-southeast")).to_be_visible()
    expect(page.locator("#overview-grid")).to_contain_text(f"edge-eu-west: v{applied()}")
    shot(page, "overview")

    # 2. Find a region.
    nav(page, "Regions")
    page.get_by_label("Find a region").fill("us-east")
    page.get_by_role("button", name="Find").click()
    expect(page.get_by_role("heading", name="eu-west")).to_have_count(0)
    page.get_by_role("link", name="us-east", exact=True).click()
    expect(page.get_by_role("heading", name=re.compile(r"^us-east"))).to_be_visible()

    # 3. Drain an instance: preview, confirm, its state changes; undrained elsewhere, the
    #    live table follows without a reload.
    inst = Instance.objects.filter(deployment__pool__region__code="us-east", state="ready").first()
    row = page.locator(f"#instance-{inst.name}")
    expect(row.locator("[data-state]")).to_have_text("ready")
    row.get_by_role("link", name=f"Drain {inst.name}").click()
    expect(page.locator("#preview")).to_contain_text(f"Stop receiving traffic: {inst.name}")
    page.locator("#confirm").click()
    expect(page.get_by_role("status")).to_contain_text(f"Instance {inst.name} is draining.")
    expect(page.locator(f"#instance-{inst.name} [data-state]")).to_have_text("draining")
    inst.refresh_from_db()
    assert inst.state == "draining"
    # Watch the drain progress, live: us-east's edge reports the requests still in flight.
    progress = page.locator(f"#instance-{inst.name} .progress-text")
    expect(progress).to_have_text("requests in flight unknown (no fresh heartbeat)")
    for left, text in (
        (3, "3 requests in flight to finish"),
        (1, "1 request in flight to finish"),
        (0, "drained: nothing in flight"),
    ):
        report = heartbeats.InstanceReport(
            inst.name, True, {"in_flight": left, "tokens_per_s": 1.0}
        )
        heartbeats.edge_heartbeat_record(
            edge=edges["us-east"], applied_table_version=None, instances=[report]
        )
        expect(progress).to_have_text(text)
        if left == 1:
            shot(page, "drain-progress")
    inventory.instance_undrain(actor=None, instance=inst)  # another operator, elsewhere
    expect(page.locator(f"#instance-{inst.name} [data-state]")).to_have_text("ready")

    # 4. Preview, then evacuate eu-west; the worker publishes, the edge applies the new version.
    before = applied()
    page.goto(base + "/console/regions/eu-west/")
    page.get_by_role("link", name="Evacuate…").click()
    preview = page.locator("#preview")
    expect(preview).to_contain_text("globex-eu")
    expect(preview).to_contain_text("become refused")
    shot(page, "evacuate-preview")
    page.locator("#confirm").click()
    expect(page.locator("#region-status")).to_have_text("evacuated")
    wait_until(lambda: applied() > before, what="the edge applying the new table", watch=edge_proc)
    nav(page, "Overview")
    expect(page.locator("#overview-grid")).to_contain_text(f"edge-eu-west: v{applied()}")
    assert latest_version("eu-west") > before

    # 5. A new key: its secret shown once.
    nav(page, "Tenants")
    page.get_by_role("link", name="acme-us").click()
    page.get_by_role("link", name="New key…").click()
    page.get_by_label("Name").fill("e2e")
    page.get_by_role("button", name="Create key").click()
    secret = page.get_by_label("Secret").input_value()
    assert secret.startswith("fi_")
    # Focusing the secret selects it (console.js, once an onfocus attribute).
    page.get_by_label("Secret").focus()
    box = "document.getElementById('secret')"
    selected = f"() => [{box}.selectionStart, {box}.selectionEnd]"
    assert page.evaluate(selected) == [0, len(secret)]
    key = ApiKey.objects.get(tenant__slug="acme-us", name="e2e")
    page.get_by_role("link", name="Done").click()
    expect(page.locator("#keys")).to_contain_text(key.prefix)
    assert secret not in page.content()

    # 6. A cost chart, and its CSV.
    nav(page, "Usage")
    expect(page.locator("#usage-chart-area[data-drawn=true] canvas")).to_have_count(1)
    expect(page.locator("#totals")).to_contain_text("meta-llama/Llama-3.1-8B-Instruct")
    shot(page, "usage")
    with page.expect_download() as download:
        page.locator("#csv").click()
    rows = list(csv.DictReader(io.StringIO(Path(download.value.path()).read_text())))
    assert rows and {"day", "model", "price_usd", "cost_usd"} <= set(rows[0])
    nav(page, "Costs")
    expect(page.locator("#cost-chart-area[data-drawn=true] canvas")).to_have_count(1)

    # 6b. The routing table's version picker (console.js, once an onchange attribute), and the
    #     Content-Security-Policy: every page above ran under it, and the browser refused nothing
    #     (htmx's polls and swaps, uPlot's charts, the previews and actions all worked).
    versions = RoutingTableVersion.objects.filter(region__code="us-east").order_by("version")
    oldest = versions.values_list("version", flat=True).first()
    answer = page.goto(base + "/console/routing/us-east/")
    assert answer is not None
    assert "script-src 'self'" in answer.headers["content-security-policy"]
    assert "unsafe-inline" not in answer.headers["content-security-policy"]
    page.locator("#version-pick").select_option(str(oldest))
    expect(page).to_have_url(re.compile(rf"\?v={oldest}$"))
    expect(page.locator("#table-version")).to_have_text(f"v{oldest}")
    nav(page, "Overview")
    expect(page.locator("#overview-grid .meter .fill").first).to_have_class(re.compile(r"\bw-\d+"))
    # htmx's poll swaps the grid in again (a new time stamp) under the policy.
    grid = page.locator("#overview-grid")
    expect(grid).not_to_have_attribute("data-updated", grid.get_attribute("data-updated") or "")
    assert page.locator("head style").count() == 0  # htmx injected no indicator <style>
    assert CSP_VIOLATIONS[page] == []

    # 7. A tenant viewer: its own tenant only; no fleet pages, no actions.
    viewer = log_in(browser, base, "globex-eu-viewer")
    expect(viewer).to_have_url(base + "/console/tenants/globex-eu/")
    expect(viewer.locator("#permitted-regions")).to_have_text("eu-west")
    shot(viewer, "tenant-viewer")
    other_key = ApiKey.objects.filter(tenant__slug="acme-us").first()
    refused = {
        "/console/tenants/acme-us/": 404,
        "/console/regions/eu-west/restore/": 403,
        f"/console/keys/{other_key.pk}/revoke/": 403,
        "/console/tenants/globex-eu/keys/new/": 403,
        "/console/audit/": 403,
    }
    for path, status in refused.items():
        assert viewer.goto(base + path).status == status, path
    # A forged POST (with a valid CSRF token from its own page) is refused too.
    viewer.goto(base + "/console/tenants/globex-eu/")
    token = viewer.context.cookies()
    csrf = next(c["value"] for c in token if c["name"] == "csrftoken")
    response = viewer.request.post(
        base + f"/console/keys/{other_key.pk}/revoke/",
        headers={"X-CSRFToken": csrf, "Referer": base + "/console/"},
    )
    assert response.status == 403
    other_key.refresh_from_db()
    assert other_key.revoked_at is None
    assert httpx.get(base + "/console/overview/", follow_redirects=False).status_code == 302
    assert CSP_VIOLATIONS[viewer] == []
