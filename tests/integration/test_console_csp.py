"""The console's Content-Security-Policy: every page carries it, and nothing on a page needs
what it forbids — no inline script, no ``on*`` handler, no ``style`` attribute or element
(``federation/core/csp.py``). The real browser's check is in ``tests/e2e``."""

from __future__ import annotations

import re
from html.parser import HTMLParser
from pathlib import Path

import pytest
from django.contrib.auth.models import User
from django.test import Client
from django.urls import URLPattern, resolve, reverse

from console import urls as console_urls
from federation.core.csp import API_POLICY, STRICT_POLICY, policy_for
from federation.inventory.models import GPUPool, Instance, LanguageModel, LoraAdapter
from federation.routing.models import RoutingTableVersion
from federation.tenancy.models import ApiKey
from tests.integration.console_support import demo_fleet

pytestmark = pytest.mark.django_db

TEMPLATES = Path(console_urls.__file__).resolve().parent / "templates"
#: What a policy must hold whatever the path (the issue's list).
REQUIRED = (
    "default-src 'self'",
    "script-src 'self'",
    "object-src 'none'",
    "base-uri 'self'",
    "frame-ancestors 'none'",
    "form-action 'self'",
)


class InlineCode(HTMLParser):
    """Collects what a strict CSP would refuse to run or apply in a page."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.found: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        named = dict(attrs)
        if tag == "script" and not named.get("src") and named.get("type") != "application/json":
            self.found.append(f"inline <script {named}>")
        if tag == "style":
            self.found.append("inline <style>")
        for name, value in attrs:
            if name.startswith("on") or name == "style" or name.startswith("hx-on"):
                self.found.append(f"<{tag} {name}={value!r}>")
            if name in ("href", "src", "action") and (value or "").strip().startswith(
                "javascript:"
            ):
                self.found.append(f"<{tag} {name}={value!r}>")


def inline_code(html: str) -> list[str]:
    parser = InlineCode()
    parser.feed(html)
    parser.close()
    return parser.found


#: Actions that answer POST only, with a redirect to a page checked here.
POST_ONLY = {"logout", "dead-letter-replay"}


def console_pages() -> dict[str, list[str]]:
    """Every console URL name -> the URLs that render it (with the demo fleet's objects).
    Names without arguments are reversed by themselves, so a new page is checked too."""
    inst = Instance.objects.filter(deployment__pool__region__code="us-east", state="ready")[0]
    pool = GPUPool.objects.get(region__code="eu-west", name="a100-pcie")
    key = ApiKey.objects.filter(tenant__slug="acme-us")[0]
    oldest = RoutingTableVersion.objects.filter(region__code="us-east").order_by("version")[0]
    with_args = {
        "region": [reverse("console:region", args=["us-east"])],
        "region-evacuate": [
            reverse("console:region-evacuate", args=["eu-west"]),
            reverse("console:region-evacuate", args=["eu-west"]) + "?preview=1",
        ],
        "region-restore": [reverse("console:region-restore", args=["eu-west"])],
        "pool-cordon": [reverse("console:pool-cordon", args=[pool.pk])],
        "pool-uncordon": [reverse("console:pool-uncordon", args=[pool.pk])],
        "instance-drain": [reverse("console:instance-drain", args=[inst.name])],
        "instance-undrain": [reverse("console:instance-undrain", args=[inst.name])],
        "routing-table": [
            reverse("console:routing-table", args=["us-east"]),
            reverse("console:routing-table", args=["us-east"]) + f"?v={oldest.version}",
        ],
        "routing-diff": [reverse("console:routing-diff", args=["us-east"])],
        "tenant": [reverse("console:tenant", args=["acme-us"])],
        "key-create": [reverse("console:key-create", args=["acme-us"])],
        "key-revoke": [reverse("console:key-revoke", args=[key.pk])],
        "key-rotate": [reverse("console:key-rotate", args=[key.pk])],
    }
    pages: dict[str, list[str]] = {}
    for pattern in console_urls.urlpatterns:
        assert isinstance(pattern, URLPattern)
        name = str(pattern.name)
        if name in POST_ONLY:
            continue
        if pattern.pattern.converters:
            assert name in with_args, f"console page {name!r} has arguments: add it here"
            pages[name] = with_args[name]
        else:
            pages[name] = [reverse(f"console:{name}")]
    return pages


@pytest.fixture
def admin() -> Client:
    demo_fleet(usage_days=2)
    client = Client()
    client.force_login(User.objects.get(username="admin"))
    return client


def assert_strict(response: object, url: str) -> None:
    policy = response["Content-Security-Policy"]  # type: ignore[index]
    assert policy == STRICT_POLICY, url
    html = response.content.decode()  # type: ignore[attr-defined]
    assert inline_code(html) == [], url


def test_the_policy_says_what_the_issue_asks_and_only_the_api_relaxes_styles() -> None:
    for policy in (STRICT_POLICY, API_POLICY):
        directives = [d.strip() for d in policy.split(";")]
        assert set(REQUIRED) <= set(directives)
        assert not any(
            "unsafe-eval" in d or (d.startswith("script-src") and "unsafe" in d) for d in directives
        )
    assert "style-src 'self'" in STRICT_POLICY.split("; ")
    assert "unsafe-inline" not in STRICT_POLICY
    assert policy_for("/console/overview/") == STRICT_POLICY
    assert policy_for("/admin/") == STRICT_POLICY
    assert policy_for("/api/docs/") == API_POLICY


def test_every_console_page_carries_the_policy_and_no_inline_code(admin: Client) -> None:
    pages = console_pages()
    assert {"overview", "tenant", "routing-table", "usage", "costs"} <= pages.keys()
    for name, urls in pages.items():
        for url in urls:
            assert resolve(url.split("?")[0]).url_name == name
            response = admin.get(url, follow=True)  # home redirects to the overview
            assert response.status_code == 200, (name, url, response.status_code)
            assert_strict(response, url)
    # The live fragments htmx swaps in, and the pages answering a write.
    for url in (reverse("console:overview"), reverse("console:region", args=["us-east"])):
        assert_strict(admin.get(url, headers={"HX-Request": "true"}), url)
    issued = admin.post(
        reverse("console:key-create", args=["acme-us"]), {"name": "csp", "scopes": ["inference"]}
    )
    assert issued.status_code == 200 and b"data-select-on-focus" in issued.content
    assert_strict(issued, "key issued")
    charted = admin.get(reverse("console:costs"))
    assert b'type="application/json"' in charted.content  # the chart's data, not code
    logout = admin.post(reverse("console:logout"))
    assert logout["Content-Security-Policy"] == STRICT_POLICY
    assert_strict(Client().get(reverse("console:login")), "login")


def test_no_console_template_holds_inline_code() -> None:
    templates = sorted(TEMPLATES.rglob("*.html"))
    assert templates
    for template in templates:
        source = template.read_text()
        # Template tags inside attributes are not HTML: blank them before parsing.
        found = inline_code(re.sub(r"{[{%#].*?[}%#]}", "x", source))
        assert found == [], template.name
        assert not re.search(r"\son[a-z]+\s*=", source), template.name


def test_admin_pages_carry_the_strict_policy(admin: Client) -> None:
    for url in ("/admin/", "/admin/inventory/loraadapter/", "/admin/login/"):
        response = admin.get(url)
        assert response.status_code in (200, 302), url
        assert response["Content-Security-Policy"] == STRICT_POLICY, url
    adapter = LoraAdapter.objects.create(
        base_model=LanguageModel.objects.all()[0], name="csp-lora", rank=8, source="/x"
    )
    for url in (
        "/admin/",
        "/admin/inventory/loraadapter/",
        f"/admin/inventory/loraadapter/{adapter.pk}/change/",
    ):
        page = admin.get(url)
        assert page.status_code == 200, url
        assert inline_code(page.content.decode()) == [], url


def test_the_api_docs_run_no_inline_script_and_only_relax_styles(admin: Client) -> None:
    docs = admin.get("/api/docs/")
    assert docs.status_code == 200
    assert docs["Content-Security-Policy"] == API_POLICY
    html = docs.content.decode()
    scripts = re.findall(r"<script\b([^>]*)>", html)
    assert scripts and all("src=" in attrs for attrs in scripts), scripts
    init = re.search(r'<script src="([^"]*script=[^"]*)"', html)
    assert init is not None
    code = admin.get(init.group(1).replace("&amp;", "&"))
    assert code.status_code == 200 and b"SwaggerUIBundle" in code.content
    api = admin.get("/api/v1/", headers={"Accept": "text/html"})
    assert api["Content-Security-Policy"] == API_POLICY
    assert "<script>" not in api.content.decode()
