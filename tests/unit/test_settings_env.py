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
    "FEDINFER_SECRET_KEY": "s" * 50,
    "DATABASE_URL": "postgres://fedinfer@db:5432/fedinfer",
    "REDIS_URL": "redis://cache:6379/0",
    "FEDINFER_TABLE_SIGNING_KEY": "t" * 64,
}


def _boot(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("FEDINFER_", "DJANGO_"))}
    clean.pop("DATABASE_URL", None)
    clean.pop("REDIS_URL", None)
    code = (
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
