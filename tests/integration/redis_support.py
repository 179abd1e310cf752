"""A Redis of the test's own, for tests that stop and restart it: stopping it disturbs
nothing else (the machine's Redis serves the other tests)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from regions.supervisor import Process, free_port, start_process, wait_until


class PrivateRedis:
    """A redis-server of the test's own on a free port, append-only file on, that the test may
    stop and start again (same port, same data)."""

    def __init__(self, tmp: Path) -> None:
        self.port = free_port()
        self.dir = tmp / "redis"
        self.dir.mkdir()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: Process | None = None

    def start(self) -> None:
        argv = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1"]
        argv += ["--dir", str(self.dir), "--appendonly", "yes", "--appendfsync", "always"]
        argv += ["--save", ""]
        self.proc = start_process("redis", argv, log=self.dir / "redis.log", append=True)
        client = redis.Redis.from_url(self.url)
        wait_until(lambda: _pings(client), what="the test's Redis", watch=self.proc)

    def stop(self) -> None:
        assert self.proc is not None
        self.proc.stop()


def _pings(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.ConnectionError:
        return False


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[PrivateRedis]:
    server = PrivateRedis(tmp_path)
    server.start()
    yield server
    server.stop()
