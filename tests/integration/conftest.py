"""Fixtures the loopback integration tests share."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.control_plane_support import Procs, stop_process_group


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Procs]:
    """Processes of this test, stopped (by process group) at its end."""
    p = Procs(tmp_path)
    yield p
    for proc in reversed(p.running):
        stop_process_group(proc)
