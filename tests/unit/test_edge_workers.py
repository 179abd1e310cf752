"""The pieces of ``fedinfer edge --workers``: holder names, each worker's settings, the checks,
and the pool's rules for a worker that dies (real forked processes, no edge in them)."""

from __future__ import annotations

import argparse
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest

from regions.edge import workers as pool_module
from regions.edge.cli import build_parser, check_workers, config_from_args
from regions.edge.workers import WorkerPool, reserve_port, worker_config
from regions.supervisor import die_with_parent
from regions.tables.schema import MAX_EDGE_WORKERS, holds_for, lease_holder, lease_holders


def test_holders_are_the_edge_and_its_numbered_workers() -> None:
    assert lease_holder("edge-eu-1", 0) == "edge-eu-1"
    assert lease_holders("edge-eu-1", 3) == ["edge-eu-1", "edge-eu-1.1", "edge-eu-1.2"]
    assert all(holds_for("edge-eu-1", h) for h in lease_holders("edge-eu-1", MAX_EDGE_WORKERS))
    for other in ["edge-eu-2", "edge-eu-1.0", "edge-eu-1.01", "edge-eu-1.x", "edge-eu-1.",
                  f"edge-eu-1.{MAX_EDGE_WORKERS}", "edge-eu-1.1.1", "edge-eu", ""]:  # fmt: skip
        assert not holds_for("edge-eu-1", other), other


def parse(*args: str, tmp: Path) -> argparse.Namespace:
    table = tmp / "t.json"
    table.write_text("{}")
    return build_parser().parse_args(["--region", "r1", "--table", str(table), *args])


def test_each_worker_but_the_first_keeps_its_state_and_spool_apart(tmp_path: Path) -> None:
    (tmp_path / "credential").write_text("edge-credential")
    opts = parse("--usage-spool-dir", str(tmp_path / "spool"), "--usage-redis-url",
                 "redis://x", "--edge-name", "e1", "--credential-file",
                 str(tmp_path / "credential"), tmp=tmp_path)  # fmt: skip
    cfg = config_from_args(opts)
    assert cfg.metering is not None
    first, second = worker_config(cfg, 0, 2), worker_config(cfg, 1, 2)
    assert (first.worker, first.workers, first.holder) == (0, 2, "e1")
    assert first.metering == cfg.metering  # an edge that ran alone keeps its spool as worker 0
    assert (second.worker, second.holder) == (1, "e1.1")
    assert second.metering is not None
    assert second.metering.spool_dir == tmp_path / "spool" / "worker-1"
    assert replace(cfg, name=None).holder is None


def test_several_workers_need_a_peer_redis_and_room_for_their_names(tmp_path: Path) -> None:
    check_workers(parse(tmp=tmp_path))  # one: nothing needed
    for args, message in [
        (("--workers", "0"), "--workers must be"),
        (("--workers", str(MAX_EDGE_WORKERS + 1)), "--workers must be"),
        (("--workers", "2"), "needs --peer-redis-url"),
        (("--workers", "12", "--peer-redis-url", "redis://x", "--edge-name", "e" * 61),
         "too long for 12 workers"),
        (("--workers", "4", "--peer-redis-url", "redis://x", "--operator-port", "65534"),
         "no room"),
    ]:  # fmt: skip
        with pytest.raises(ValueError, match=message):
            check_workers(parse(*args, tmp=tmp_path))
    check_workers(parse("--workers", "9", "--peer-redis-url", "redis://x", "--edge-name",
                        "e" * 61, tmp=tmp_path))  # fmt: skip


def test_the_reserved_port_is_one_port_for_every_worker() -> None:
    held = reserve_port("127.0.0.1", 0)
    with held:
        port = held.getsockname()[1]
        again = reserve_port("127.0.0.1", port)  # a worker binds beside it
        again.listen()
        again.close()


def test_a_worker_that_fails_before_it_serves_stops_the_edge() -> None:
    def start(worker: int, ready: Callable[[], None]) -> None:
        if worker == 1:
            raise SystemExit(3)
        time.sleep(30)

    began = time.monotonic()
    assert WorkerPool(2, start).run() == 1
    assert time.monotonic() - began < 10  # the healthy one was stopped, not waited for


def test_a_worker_that_dies_after_serving_is_restarted_and_a_signal_stops_them_all(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(pool_module, "RESTART_S", (0.1, 0.2))
    starts = tmp_path / "starts"

    def start(worker: int, ready: Callable[[], None]) -> None:
        with starts.open("a") as f:
            f.write(f"{worker}\n")
        ready()
        runs = starts.read_text().split().count(str(worker))
        if worker == 1 and runs == 1:
            os._exit(9)  # a crash after it served
        signal.signal(signal.SIGTERM, lambda *_: os._exit(0))  # drained, as an edge does
        time.sleep(30)

    pool = WorkerPool(2, start)

    def stop_when_restarted() -> None:
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            if starts.exists() and starts.read_text().split().count("1") == 2:
                time.sleep(0.3)
                os.kill(os.getpid(), signal.SIGTERM)
                return
            time.sleep(0.05)

    threading.Thread(target=stop_when_restarted, daemon=True).start()
    assert pool.run() == 0
    assert sorted(starts.read_text().split()) == ["0", "1", "1"]


def test_a_child_whose_parent_died_before_it_asked_ends_at_once() -> None:
    """``die_with_parent``: the race between a parent's death and the child's prctl (a Celery
    beat left behind in CI) ends the child as the parent's death would have."""
    pid = os.fork()
    if pid == 0:  # the child: its real parent is alive, but it is told of another
        die_with_parent(-1)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGTERM
