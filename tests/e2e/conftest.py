"""Headless Chromium for the console's end-to-end tests: Debian's ``chromium`` (installed by
``.ci/run``), driven by Playwright. A missing browser fails the tests; it does not skip them."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from django.db import connections
from playwright.sync_api import Browser, sync_playwright

from regions.supervisor import Supervisor

SCREENSHOTS = Path(__file__).resolve().parents[2] / "var" / "screenshots"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


#: Playwright's sync API runs an event loop in the test's thread, which Django's ORM takes for
#: async code; the test's own queries are plain blocking ones. Not passed to the subprocesses.
ASYNC_UNSAFE = "DJANGO_ALLOW_ASYNC_UNSAFE"


@pytest.fixture
def browser(monkeypatch: pytest.MonkeyPatch) -> Iterator[Browser]:
    monkeypatch.setenv(ASYNC_UNSAFE, "true")
    executable = shutil.which("chromium")
    if executable is None:
        pytest.fail("chromium is not installed: the console's e2e tests need it (.ci/run)")
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=executable, args=CHROMIUM_ARGS)
        try:
            yield browser
        finally:
            browser.close()
            # The test's queries ran while Playwright's loop was running, on connections
            # Django keeps apart for that context: close them before the database is dropped.
            connections.close_all()


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Supervisor]:
    """Processes of this test, logs in its ``tmp_path``, stopped (by process group) at its end."""
    with Supervisor(tmp_path, grace_s=15.0) as supervisor:
        yield supervisor
