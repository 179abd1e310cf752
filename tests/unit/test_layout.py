"""The repository's shape is part of the architecture: keep it so."""

from __future__ import annotations

import platform
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_stdlib_platform_module_is_not_shadowed() -> None:
    assert Path(platform.__file__).parent != ROOT, "a top-level 'platform' package shadows stdlib"
    assert not (ROOT / "platform" / "__init__.py").exists()
    assert callable(platform.python_version)


def test_region_packages_import_without_django() -> None:
    """Importing every module of regions/ must not load Django (the region never imports it)."""
    modules = sorted(
        ".".join(path.relative_to(ROOT).with_suffix("").parts)
        for path in (ROOT / "regions").rglob("*.py")
        if path.name != "__main__.py"
    )
    code = (
        "import importlib, sys\n"
        f"for name in {modules!r}:\n"
        "    importlib.import_module(name.removesuffix('.__init__'))\n"
        "bad = sorted(m for m in sys.modules\n"
        "             if m.split('.')[0] in {'django', 'rest_framework', 'federation'})\n"
        "assert not bad, bad\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_every_app_keeps_its_migrations_in_the_top_level_package() -> None:
    from django.conf import settings

    for app_label, module in settings.MIGRATION_MODULES.items():
        assert module == f"migrations.{app_label}"
        assert (ROOT / "migrations" / app_label / "__init__.py").exists()
    stray = [p for p in (ROOT / "federation").rglob("migrations") if p.is_dir()]
    assert not stray, f"migrations must live in migrations/, found {stray}"
