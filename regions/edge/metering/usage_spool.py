"""The edge's usage spool: every usage record on local disk until the control plane has it.

Records are appended to memory on the request path as rows (no I/O, no encoding there), and
encoded in one call and written to the current segment file with one ``fdatasync`` per small
batch (``UsageShipper.flush``, from a background task). A shipper sends what is on disk and
only then moves the *acknowledged* cursor, which is itself written atomically; segments wholly
before it are deleted. So a record leaves the spool only once accepted, and a crash loses at
most the batch not yet flushed; a batch shipped but not yet acknowledged when the edge stops is
shipped again after the restart (ingestion is idempotent on the request id).

Format: ``usage-<12-digit sequence>.jsonl``, one JSON record per line. A line cut by a crash (no
final newline) is truncated away on open. The spool is bounded (``max_bytes``); what the edge
does when it is full is its policy (``--usage-spool-full``), not the spool's. The bound is
checked when bytes reach or leave the disk (a flush, an acknowledgement), not per request: a
request reads one flag, and the spool may pass its bound by the rows of one flush interval.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from regions.tables.usage import encode_usage_lines

SEGMENT_GLOB = "usage-*.jsonl"
ACKED_FILE = "acked"
#: Records name tenants, models and request ids: only the edge's own user reads them.
PRIVATE_DIRECTORY_MODE = 0o700
PRIVATE_FILE_MODE = 0o600


def make_private_directory(directory: Path) -> None:
    """Create ``directory`` (and its parents) and make it and the files already in it private
    to the edge's user: a spool written by an older edge (0755/0644) is closed at open too."""
    directory.mkdir(mode=PRIVATE_DIRECTORY_MODE, parents=True, exist_ok=True)
    os.chmod(directory, PRIVATE_DIRECTORY_MODE)
    for path in [*directory.glob(SEGMENT_GLOB), directory / ACKED_FILE]:
        if path.is_file() and not path.is_symlink():
            os.chmod(path, PRIVATE_FILE_MODE)


@dataclass(frozen=True, slots=True, order=True)
class Cursor:
    """A position in the spool: a segment's sequence number and a byte offset in it."""

    segment: int
    offset: int


@dataclass(frozen=True, slots=True)
class Batch:
    #: The records, each a line ending in a newline (what a sink sends as it is).
    data: bytes
    count: int
    #: Where the spool continues after these records (what :meth:`UsageSpool.ack` takes).
    end: Cursor

    @property
    def records(self) -> list[bytes]:
        """The records one by one, without their newlines."""
        return self.data.splitlines()


class UsageSpool:
    """Append-only, bounded, crash-safe store of encoded usage records (one process owns it)."""

    # Slots: every request reads ``full`` and calls ``append``.
    __slots__ = (
        "_buffer", "_disk_bytes", "_encode_lines", "_fd", "_fd_segment", "_persisted",
        "_segments", "_taken", "acked", "append", "directory", "end", "full", "max_bytes",
        "segment_bytes",
    )  # fmt: skip

    def __init__(
        self,
        directory: Path,
        *,
        max_bytes: int = 256 << 20,
        segment_bytes: int = 8 << 20,
        encode_lines: Callable[[list[Any]], bytes] = encode_usage_lines,
    ) -> None:
        if max_bytes < segment_bytes or segment_bytes < 1:
            raise ValueError("max_bytes must be at least one segment (segment_bytes >= 1)")
        self.directory = directory
        self.max_bytes = max_bytes
        self.segment_bytes = segment_bytes
        make_private_directory(directory)
        self._encode_lines = encode_lines
        self._buffer: list[Any] = []
        #: Buffer one record's row, encoded and written by the next flush: the list's own
        #: ``append``, so a request pays for no Python call (:meth:`take_buffer` keeps the list).
        self.append: Callable[[Any], None] = self._buffer.append
        #: Rows handed to :meth:`write` so far.
        self._taken = 0
        self.acked = self._read_acked()
        self._persisted = self.acked
        self._segments = self._recover()
        #: Bytes on disk from the acknowledged cursor on (what the bound counts).
        self._disk_bytes = sum(self._size(s) for s in self._segments) - self.acked.offset
        #: The records not yet acknowledged fill ``max_bytes`` (updated as that changes).
        self.full = self._disk_bytes >= max_bytes
        #: Where the next write goes.
        self.end = Cursor(self._segments[-1], self._size(self._segments[-1]))
        self._fd: int | None = None
        self._fd_segment = -1

    # --- the request path ----------------------------------------------------------------

    @property
    def unshipped_bytes(self) -> int:
        """Bytes on disk not yet acknowledged (rows in memory are not encoded yet)."""
        return self._disk_bytes

    @property
    def appended(self) -> int:
        """Rows appended since the spool was opened."""
        return self._taken + len(self._buffer)

    @property
    def caught_up(self) -> bool:
        """Everything written is acknowledged: what is written next can be shipped from memory."""
        return self.acked == self.end

    # --- the background task -------------------------------------------------------------

    def take_buffer(self) -> list[Any]:
        """Hand the buffered rows to :meth:`write` (call on the thread that appends)."""
        rows = self._buffer.copy()
        self._buffer.clear()
        self._taken += len(rows)
        return rows

    def write(self, rows: list[Any]) -> Batch:
        """Encode ``rows`` (one call for all), append them to the current segment and fdatasync
        (may run in a worker thread): what was written, and the cursor after it."""
        if not rows:
            return Batch(b"", 0, self.end)
        data = self._encode_lines(rows)
        end = self.end
        if end.offset >= self.segment_bytes:
            end = Cursor(end.segment + 1, 0)
            self._segments.append(end.segment)
        fd = self._segment_fd(end.segment)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fdatasync(fd)  # the data and the new size: what a reader after a crash needs
        if end.offset == 0:  # a new file: make its name durable too
            self._fsync_directory()
        self._disk_bytes += len(data)
        self.full = self._disk_bytes >= self.max_bytes
        self.end = Cursor(end.segment, end.offset + len(data))
        return Batch(data, len(rows), self.end)

    def close(self) -> None:
        """Close the open segment (the spool stays usable: the next write reopens it)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def read(self, limit: int, start: Cursor | None = None) -> Batch:
        """Up to ``limit`` records on disk from ``start`` (default: the acknowledged cursor)."""
        cursor = start or self.acked
        records: list[bytes] = []  # each with its newline
        for segment in self._segments:
            if segment < cursor.segment or len(records) >= limit:
                continue
            offset = cursor.offset if segment == cursor.segment else 0
            path = self._path(segment)
            if not path.exists():  # nothing written yet
                break
            with open(path, "rb") as f:
                f.seek(offset)
                for line in f:
                    if not line.endswith(b"\n"):
                        break  # being written right now: the next read gets it
                    records.append(line)
                    offset += len(line)
                    if len(records) >= limit:
                        break
            cursor = Cursor(segment, offset)
        return Batch(b"".join(records), len(records), cursor)

    def ack(self, cursor: Cursor) -> None:
        """Everything before ``cursor`` was accepted (in memory: :meth:`persist` writes it)."""
        if cursor <= self.acked:
            return
        self._disk_bytes -= self._bytes_between(self.acked, cursor)
        self.full = self._disk_bytes >= self.max_bytes
        self.acked = cursor

    def persist(self) -> None:
        """Write the acknowledged cursor (atomically) and delete the segments before it. Until
        it is written, a restart ships those records again: ingestion counts them once."""
        cursor = self.acked
        if cursor == self._persisted:
            return
        tmp = self.directory / (ACKED_FILE + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, PRIVATE_FILE_MODE)
        with open(fd, "w") as f:
            f.write(f"{cursor.segment} {cursor.offset}\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.directory / ACKED_FILE)
        self._fsync_directory()
        self._persisted = cursor
        while len(self._segments) > 1 and self._segments[0] < cursor.segment:
            self._path(self._segments.pop(0)).unlink(missing_ok=True)

    # --- files ---------------------------------------------------------------------------
    def _segment_fd(self, segment: int) -> int:
        """The segment's file, kept open for appending: one open per segment, not per batch."""
        if self._fd_segment != segment or self._fd is None:
            self.close()
            flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT
            self._fd = os.open(self._path(segment), flags, PRIVATE_FILE_MODE)
            self._fd_segment = segment
        return self._fd

    def _path(self, segment: int) -> Path:
        return self.directory / f"usage-{segment:012d}.jsonl"

    def _size(self, segment: int) -> int:
        try:
            return self._path(segment).stat().st_size
        except FileNotFoundError:
            return 0

    def _bytes_between(self, start: Cursor, end: Cursor) -> int:
        if start.segment == end.segment:
            return end.offset - start.offset
        middle = sum(self._size(s) for s in self._segments if start.segment < s < end.segment)
        return self._size(start.segment) - start.offset + middle + end.offset

    def _read_acked(self) -> Cursor:
        try:
            segment, offset = (self.directory / ACKED_FILE).read_text().split()
        except FileNotFoundError:
            return Cursor(0, 0)
        return Cursor(int(segment), int(offset))

    def _recover(self) -> list[int]:
        """Segments from the acknowledged one on; a torn last line is cut off."""
        found = sorted(int(p.name[6:18]) for p in self.directory.glob(SEGMENT_GLOB))
        for segment in found:
            if segment < self.acked.segment:
                self._path(segment).unlink()
        segments = [s for s in found if s >= self.acked.segment] or [self.acked.segment]
        last = self._path(segments[-1])
        if last.exists():
            data = last.read_bytes()
            keep = data.rfind(b"\n") + 1
            if keep != len(data):
                with open(last, "r+b") as f:
                    f.truncate(keep)
                    os.fsync(f.fileno())
        return segments

    def _fsync_directory(self) -> None:
        fd = os.open(self.directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
