"""The routing table the edge persists (tenants' key hashes, cache salts) is its user's alone."""

from __future__ import annotations

from pathlib import Path

from regions.edge.control.table_sync import persist_table


def test_the_persisted_table_and_a_state_directory_it_creates_are_private(
    tmp_path: Path,
) -> None:
    path = tmp_path / "state" / "table.json"
    persist_table(path, b'{"region": "r1"}')
    persist_table(path, b'{"region": "r1", "version": 2}')  # replaced, still private
    assert path.read_bytes() == b'{"region": "r1", "version": 2}'
    assert path.stat().st_mode & 0o777 == 0o600
    assert path.parent.stat().st_mode & 0o777 == 0o700
    assert [p.name for p in path.parent.iterdir()] == ["table.json"]  # no temp file left
