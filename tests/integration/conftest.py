"""Fixtures the loopback integration tests share."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from regions.supervisor import Supervisor


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Supervisor]:
    """Processes of this test, logs in its ``tmp_path``, stopped (by process group) at its end."""
    with Supervisor(tmp_path, grace_s=15.0) as supervisor:
        yield supervisor
