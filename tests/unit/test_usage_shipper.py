"""The shipper: in the common case a batch goes out from memory as soon as it is on disk; after
a failure everything waits on disk and goes out oldest first, nothing lost or reordered."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from regions.edge.cli import build_parser, config_from_args
from regions.edge.metering.meter import Meter
from regions.edge.metering.usage_shipper import UsageShipper
from regions.edge.metering.usage_spool import UsageSpool
from regions.tables.usage import usage_stream_key


class Sink:
    def __init__(self) -> None:
        self.up = True
        self.batches: list[list[bytes]] = []

    async def send(self, data: bytes) -> None:
        if not self.up:
            raise ConnectionError("sink away")
        assert data.endswith(b"\n")
        self.batches.append(data.splitlines())

    async def close(self) -> None:
        pass


def row(i: int) -> dict[str, int]:
    return {"n": i}


def rec(i: int) -> bytes:
    """``row(i)`` as the sink receives it."""
    return b'{"n":%d}' % i


def test_caught_up_batches_go_from_memory_and_a_backlog_goes_oldest_first(tmp_path: Path) -> None:
    spool = UsageSpool(tmp_path)
    sink = Sink()
    shipper = UsageShipper(spool, sink, batch=3)

    async def run() -> None:
        spool.append(row(1))
        spool.append(row(2))
        await shipper.cycle()
        assert sink.batches == [[rec(1), rec(2)]] and spool.caught_up
        sink.up = False
        spool.append(row(3))
        await shipper.cycle()
        assert shipper.stats.failing_for == 1 and not spool.caught_up
        sink.up = True
        for i in (4, 5, 6, 7):
            spool.append(row(i))
        await shipper.cycle()  # the backlog first, from disk, in batches of 3
        # Within a second of the last write of the cursor, a restart would ship them again.
        assert UsageSpool(tmp_path).read(10).records != []
        await shipper.stop()  # writes the cursor

    asyncio.run(run())
    assert sink.batches[1:] == [[rec(3), rec(4), rec(5)], [rec(6), rec(7)]]
    assert spool.caught_up and spool.unshipped_bytes == 0
    assert shipper.stats.shipped == 7 and shipper.stats.failing_for == 0
    assert UsageSpool(tmp_path).read(10).records == []  # acknowledged on disk now


def test_a_batch_larger_than_the_sinks_goes_from_disk_in_pieces(tmp_path: Path) -> None:
    spool = UsageSpool(tmp_path)
    sink = Sink()
    shipper = UsageShipper(spool, sink, batch=2)
    for i in range(5):
        spool.append(row(i))
    asyncio.run(shipper.cycle())
    assert sink.batches == [[rec(0), rec(1)], [rec(2), rec(3)], [rec(4)]]
    assert spool.caught_up


def test_the_flush_interval_flag_sets_the_shippers_interval(tmp_path: Path) -> None:
    args = ["--region", "r1", "--table", "t.json", "--usage-spool-dir", str(tmp_path)]
    (tmp_path / "credential").write_text("edge-credential")
    args += ["--usage-redis-url", "redis://127.0.0.1:1/0", "--edge-name", "e1"]
    args += ["--credential-file", str(tmp_path / "credential")]
    default = config_from_args(build_parser().parse_args(args))
    assert default.metering is not None and default.metering.flush_interval_s == 0.2
    opts = build_parser().parse_args([*args, "--usage-flush-interval", "0.5"])
    cfg = config_from_args(opts).metering
    assert cfg is not None
    assert Meter(cfg, Sink()).shipper.interval_s == 0.5
    for bad in ("0", "-1", "61"):
        with pytest.raises(ValueError, match="--usage-flush-interval"):
            config_from_args(build_parser().parse_args([*args, "--usage-flush-interval", bad]))


def test_shipping_to_the_stream_needs_the_edges_name_and_credential(tmp_path: Path) -> None:
    """The worker ingests only entries signed with a registered edge's credential: an edge
    that could not sign them is refused at start-up, with what it needs."""
    args = ["--region", "r1", "--table", "t.json", "--usage-spool-dir", str(tmp_path)]
    args += ["--usage-redis-url", "redis://127.0.0.1:1/0"]
    (tmp_path / "credential").write_text("edge-credential\n")
    for missing in (["--edge-name", "e1"], ["--credential-file", str(tmp_path / "credential")]):
        with pytest.raises(ValueError, match="--usage-redis-url needs --edge-name and"):
            config_from_args(build_parser().parse_args([*args, *missing]))
    named = [*args, "--edge-name", "e1", "--credential-file", str(tmp_path / "credential")]
    cfg = config_from_args(build_parser().parse_args(named)).metering
    assert cfg is not None and cfg.stream_edge == "e1"
    assert cfg.stream_key == usage_stream_key("edge-credential")
