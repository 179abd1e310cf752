"""Read a routing table from a file (``--table``) and notice when the file changes."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from regions.tables.schema import RoutingTable, TableError, decode_table


@dataclass(frozen=True, slots=True)
class FileStamp:
    """What identifies one version of the file on disk (cheap change detection)."""

    mtime_ns: int
    size: int
    inode: int


def file_stamp(path: Path) -> FileStamp:
    st = os.stat(path)
    return FileStamp(st.st_mtime_ns, st.st_size, st.st_ino)


def read_table_file(path: Path) -> RoutingTable:
    """Read and decode ``path``; I/O errors become :class:`TableError` too."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise TableError(f"cannot read routing table {path}: {exc}") from exc
    return decode_table(data)
