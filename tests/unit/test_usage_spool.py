"""The usage spool: records survive restarts and torn writes, leave only once acknowledged,
and the bound counts what is not yet acknowledged."""

from __future__ import annotations

from pathlib import Path

import pytest

from regions.edge.metering.usage_spool import Cursor, UsageSpool


def row(i: int) -> dict[str, str]:
    """A row as the spool buffers it (any value the encoder takes)."""
    return {"request_id": f"r{i}"}


def rec(i: int) -> bytes:
    """The same record as written and read back: one line of JSON, 19 bytes."""
    return b'{"request_id":"r%d"}' % i


def test_records_are_read_back_in_order_and_only_after_a_flush(tmp_path: Path) -> None:
    spool = UsageSpool(tmp_path)
    for i in range(3):
        spool.append(row(i))
    assert spool.read(10).records == []  # buffered, not on disk
    buffered = spool.take_buffer()
    assert buffered == [row(0), row(1), row(2)]
    written = spool.write(buffered)
    assert (written.data, written.count) == (rec(0) + b"\n" + rec(1) + b"\n" + rec(2) + b"\n", 3)
    assert spool.read(10).records == [rec(0), rec(1), rec(2)]
    assert spool.read(2).records == [rec(0), rec(1)]


def test_a_record_leaves_only_once_acknowledged_and_that_survives_a_restart(
    tmp_path: Path,
) -> None:
    spool = UsageSpool(tmp_path)
    for i in range(5):
        spool.append(row(i))
    spool.write(spool.take_buffer())
    first = spool.read(2)
    assert spool.read(10).records[:2] == first.records  # unacknowledged: read again
    spool.ack(first.end)
    assert spool.read(10).records == [rec(2), rec(3), rec(4)]
    # Acknowledged but not yet persisted: a restart ships those two again (at least once).
    assert UsageSpool(tmp_path).read(10).records == [rec(i) for i in range(5)]
    spool.persist()
    reopened = UsageSpool(tmp_path)
    assert reopened.read(10).records == [rec(2), rec(3), rec(4)]
    reopened.ack(reopened.read(10).end)
    reopened.persist()
    assert UsageSpool(tmp_path).read(10).records == []


def test_an_unacknowledged_batch_is_shipped_again_after_a_restart(tmp_path: Path) -> None:
    spool = UsageSpool(tmp_path)
    spool.append(row(1))
    spool.write(spool.take_buffer())
    spool.read(10)  # sent, but the edge stopped before the acknowledgement
    assert UsageSpool(tmp_path).read(10).records == [rec(1)]


def test_a_line_torn_by_a_crash_is_cut_off_and_writing_goes_on(tmp_path: Path) -> None:
    spool = UsageSpool(tmp_path)
    spool.append(row(1))
    spool.write(spool.take_buffer())
    segment = next(tmp_path.glob("usage-*.jsonl"))
    with open(segment, "ab") as f:
        f.write(b'{"request_id":"r2"')  # the crash came mid-write
    reopened = UsageSpool(tmp_path)
    reopened.append(row(3))
    reopened.write(reopened.take_buffer())
    assert reopened.read(10).records == [rec(1), rec(3)]


def test_segments_roll_over_and_finished_ones_are_deleted(tmp_path: Path) -> None:
    spool = UsageSpool(tmp_path, max_bytes=1000, segment_bytes=40)
    for i in range(10):
        spool.append(row(i))
        spool.write(spool.take_buffer())
    assert len(list(tmp_path.glob("usage-*.jsonl"))) >= 4
    batch = spool.read(100)
    assert batch.records == [rec(i) for i in range(10)]
    spool.ack(batch.end)
    spool.persist()
    assert len(list(tmp_path.glob("usage-*.jsonl"))) == 1
    assert spool.unshipped_bytes == 0
    spool.append(row(10))
    spool.write(spool.take_buffer())
    assert UsageSpool(tmp_path, max_bytes=1000, segment_bytes=40).read(10).records == [rec(10)]


def test_the_bound_counts_unacknowledged_bytes_on_disk_as_they_come_and_go(
    tmp_path: Path,
) -> None:
    spool = UsageSpool(tmp_path, max_bytes=70, segment_bytes=70)
    for i in range(1, 5):
        spool.append(row(i))
    assert not spool.full  # rows in memory: checked when they reach the disk
    spool.write(spool.take_buffer())  # 4 x (19 bytes + newline)
    assert spool.full and spool.unshipped_bytes == 80
    assert UsageSpool(tmp_path, max_bytes=70, segment_bytes=70).full  # and after a restart
    spool.ack(spool.read(1).end)
    assert not spool.full and spool.unshipped_bytes == 60
    spool.persist()
    assert UsageSpool(tmp_path, max_bytes=70, segment_bytes=70).unshipped_bytes == 60
    spool.append(row(5))
    spool.write(spool.take_buffer())
    assert spool.full and spool.appended == 5


def test_acknowledging_an_older_cursor_changes_nothing(tmp_path: Path) -> None:
    spool = UsageSpool(tmp_path)
    spool.append(row(1))
    spool.append(row(2))
    spool.write(spool.take_buffer())
    spool.ack(spool.read(2).end)
    spool.ack(Cursor(0, 0))
    assert spool.read(10).records == []


def test_a_bound_smaller_than_a_segment_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        UsageSpool(tmp_path, max_bytes=10, segment_bytes=100)


def mode(path: Path) -> int:
    return path.stat().st_mode & 0o777


def test_the_spool_is_readable_by_the_edges_user_alone(tmp_path: Path) -> None:
    """Records name tenants, models and request ids: directory 0700, every file 0600, whatever
    the umask; a spool an older edge left readable (0755/0644) is closed when it is opened."""
    directory = tmp_path / "spool"
    spool = UsageSpool(directory)
    spool.append(row(1))
    spool.write(spool.take_buffer())
    spool.ack(spool.read(10).end)
    spool.persist()
    spool.close()
    files = sorted(directory.iterdir())
    assert [p.name for p in files] == ["acked", "usage-000000000000.jsonl"]
    assert mode(directory) == 0o700
    assert [mode(p) for p in files] == [0o600, 0o600]
    directory.chmod(0o755)
    for path in files:
        path.chmod(0o644)
    UsageSpool(directory).close()
    assert mode(directory) == 0o700
    assert [mode(p) for p in files] == [0o600, 0o600]
