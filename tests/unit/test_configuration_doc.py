"""Every ``FEDINFER_*`` variable the settings read is documented in docs/configuration.md."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_setting_of_the_environment_is_documented() -> None:
    read = set(
        re.findall(r"\"(FEDINFER_[A-Z0-9_]+)\"", (ROOT / "federation/settings.py").read_text())
    )
    documented = set(
        re.findall(r"`(FEDINFER_[A-Z0-9_]+)`", (ROOT / "docs/configuration.md").read_text())
    )
    assert len(read) > 50  # the pattern finds them
    assert sorted(read - documented) == []
