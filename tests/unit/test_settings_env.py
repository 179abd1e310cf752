"""Settings come from the environment; production refuses to boot without what it needs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROD = {
    "FEDINFER_MODE": "production",
    # 50 varied characters: what check --deploy asks of a secret key (W009).
    "FEDINFER_SECRET_KEY": "aZ3$kQ9!mW2@xR7#pL5%tY8^vB1&nC4*hJ6(gF0)dS-uE=iO+q",
    "DATABASE_URL": "postgres://fedinfer@db:5432/fedinfer",
    "REDIS_URL": "redis://cache:6379/0",
    "FEDINFER_TABLE_SIGNING_KEY": "t" * 64,
}


def _clean_environ() -> dict[str, str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("FEDINFER_", "DJANGO_"))}
    clean.pop("DATABASE_URL", None)
    clean.pop("REDIS_URL", None)
    return clean


def _boot(env: dict[str, str], code: str | None = None) -> subprocess.CompletedProcess[str]:
    clean = _clean_environ()
    code = code or (
        "from django.conf import settings\n"
        "print(settings.DATABASES['default']['ENGINE'], settings.DEBUG)"
    )
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env={**clean, "DJANGO_SETTINGS_MODULE": "federation.settings", **env},
        capture_output=True,
        text=True,
    )


def test_production_boots_with_everything_set() -> None:
    result = _boot(PROD)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["django.db.backends.postgresql", "False"]


@pytest.mark.parametrize(
    "missing", ["FEDINFER_SECRET_KEY", "DATABASE_URL", "REDIS_URL", "FEDINFER_TABLE_SIGNING_KEY"]
)
def test_production_refuses_to_boot_without_a_required_variable(missing: str) -> None:
    result = _boot({k: v for k, v in PROD.items() if k != missing})
    assert result.returncode != 0
    assert f"{missing} is required when FEDINFER_MODE=production" in result.stderr


def test_embedded_mode_needs_nothing(tmp_path: Path) -> None:
    result = _boot({"FEDINFER_VAR_DIR": str(tmp_path)})
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["django.db.backends.sqlite3", "True"]


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("FEDINFER_DEBUG", "perhaps"),
        ("FEDINFER_MAX_BODY_BYTES", "1MB"),
        ("FEDINFER_MODE", "prod"),
        ("FEDINFER_TRUSTED_PROXIES", "-1"),
        ("FEDINFER_TRUSTED_PROXIES", "all"),
    ],
)
def test_malformed_values_stop_the_boot_naming_the_variable(
    key: str, value: str, tmp_path: Path
) -> None:
    result = _boot({"FEDINFER_VAR_DIR": str(tmp_path), key: value})
    assert result.returncode != 0
    assert key in result.stderr


# --- production hardening -----------------------------------------------------------------

SECURITY = (
    "from django.conf import settings as s\n"
    "print(s.SESSION_COOKIE_SECURE, s.CSRF_COOKIE_SECURE, s.SECURE_HSTS_SECONDS,"
    " s.SECURE_HSTS_INCLUDE_SUBDOMAINS, s.SECURE_CONTENT_TYPE_NOSNIFF, s.X_FRAME_OPTIONS,"
    " s.SECURE_SSL_REDIRECT, getattr(s, 'SECURE_PROXY_SSL_HEADER', None),"
    " s.FEDINFER_TOKEN_TTL_HOURS, sep='|')"
)


def test_production_turns_on_https_and_browser_hardening() -> None:
    result = _boot(PROD, SECURITY)
    assert result.returncode == 0, result.stderr
    # Without a proxy header an HTTPS request cannot be told apart: no redirect (it would
    # loop), which check --deploy reports (see the next test).
    assert result.stdout.strip().split("|") == [
        "True", "True", "31536000", "True", "True", "DENY", "False", "None", "24"
    ]  # fmt: skip
    behind_proxy = {
        **PROD,
        "FEDINFER_PROXY_SSL_HEADER": "X-Forwarded-Proto",
        "FEDINFER_HSTS_SECONDS": "600",
        "FEDINFER_TOKEN_TTL_HOURS": "8",
    }
    result = _boot(behind_proxy, SECURITY)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().split("|") == [
        "True", "True", "600", "True", "True", "DENY", "True",
        "('HTTP_X_FORWARDED_PROTO', 'https')", "8",
    ]  # fmt: skip
    result = _boot({**behind_proxy, "FEDINFER_SSL_REDIRECT": "false"}, SECURITY)
    assert result.stdout.strip().split("|")[6] == "False"


def test_embedded_mode_keeps_plain_http_cookies(tmp_path: Path) -> None:
    result = _boot({"FEDINFER_VAR_DIR": str(tmp_path)}, SECURITY)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().split("|")[:3] == ["False", "False", "0"]


def test_production_refuses_debug() -> None:
    result = _boot({**PROD, "FEDINFER_DEBUG": "true"})
    assert result.returncode != 0
    assert "FEDINFER_DEBUG=true is refused when FEDINFER_MODE=production" in result.stderr


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("FEDINFER_PROXY_SSL_HEADER", "X-Forwarded-Proto: https"),
        ("FEDINFER_TOKEN_TTL_HOURS", "0"),
        ("FEDINFER_HSTS_SECONDS", "a year"),
    ],
)
def test_malformed_production_values_stop_the_boot(key: str, value: str) -> None:
    result = _boot({**PROD, key: value})
    assert result.returncode != 0
    assert key in result.stderr


def _check_deploy(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "manage.py", "check", "--deploy", "--fail-level", "WARNING"],
        cwd=ROOT,
        env={**_clean_environ(), "DJANGO_SETTINGS_MODULE": "federation.settings", **env},
        capture_output=True,
        text=True,
    )


def test_check_deploy_passes_in_production_behind_a_tls_proxy() -> None:
    result = _check_deploy({**PROD, "FEDINFER_PROXY_SSL_HEADER": "X-Forwarded-Proto"})
    assert result.returncode == 0, result.stdout + result.stderr
    assert "System check identified no issues (1 silenced)." in result.stdout, result.stdout


def test_check_deploy_names_what_production_lacks_without_the_proxy_header() -> None:
    result = _check_deploy(PROD)
    assert result.returncode != 0
    assert "security.W008" in result.stderr  # no HTTPS redirect
    assert "W004" not in result.stderr and "W012" not in result.stderr


def test_a_fleet_pass_outlives_the_passes_queued_before_it() -> None:
    """Reconcile, failover and autoscale share the workers on one period: a pass that expired
    after one period would, behind a reconcile taking a period, never run (seen: every
    failover pass discarded under load). Each may wait three periods."""
    code = (
        "from django.conf import settings\n"
        "s = settings.CELERY_BEAT_SCHEDULE\n"
        "print(*(s[f'fleet-{t}']['options']['expires'] / s[f'fleet-{t}']['schedule']"
        " for t in ('reconcile', 'failover', 'autoscale')))"
    )
    result = _boot({"FEDINFER_FLEET_INTERVAL_SECONDS": "1"}, code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["3.0", "3.0", "3.0"]
