"""What the fleet's integration tests share: a local provisioner on the test's own engines
folder, cleaned up at the end; ``ps`` as the outside witness of what runs; the test's own Redis
database; and the waits and instance views their assertions read."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from federation.inventory.models import Deployment
from regions.supervisor import Supervisor
from tests.integration.control_plane_support import own_redis
from workers.provisioners.local import ENV_OWNER, LocalProvisioner

#: The Redis database of the fleet tests' workers and edges.
REDIS_URL = os.environ["REDIS_URL"]  # this test worker's own (tests/isolation.py)


@pytest.fixture(autouse=True)
def redis_of_this_test(settings: Any) -> Iterator[None]:
    with own_redis(settings, REDIS_URL):
        yield


def wait_until(check: Callable[[], Any], timeout: float, what: str, log: Path) -> float:
    """Seconds until ``check()`` holds; past ``timeout``, fail with the end of ``log``."""
    started = time.monotonic()
    while not check():
        if time.monotonic() - started > timeout:
            raise AssertionError(f"{what}: not within {timeout} s\n{log.read_text()[-3000:]}")
        time.sleep(0.1)
    return time.monotonic() - started


def states(dep: Deployment) -> dict[str, str]:
    """Instance name -> state, for the deployment's instances."""
    return dict(dep.instances.values_list("name", "state"))


def ready(dep: Deployment) -> set[str]:
    return {n for n, s in states(dep).items() if s == "ready"}


def live(dep: Deployment) -> set[str]:
    """Instances that hold (or will hold) an engine: neither failed nor stopped."""
    return {n for n, s in states(dep).items() if s not in ("failed", "stopped")}


@pytest.fixture
def engines(tmp_path: Path, procs: Supervisor) -> Iterator[LocalProvisioner]:
    """A local provisioner whose engines live under this test. At the end the test's
    processes (a worker that could start more engines) are stopped first, then every engine
    left: engines outlive the worker that started them, by design."""
    provisioner = LocalProvisioner(tmp_path / "engines")
    try:
        yield provisioner
    finally:
        procs.stop_all()
        for name in provisioner.running():
            provisioner.stop(name)


def ps_engines(provisioner: LocalProvisioner) -> list[int]:
    """Pids of live (not zombie) engine-sim processes of this provisioner, as ``ps`` lists
    them; independent of the provisioner's own listing."""
    out = subprocess.run(
        ["ps", "-eww", "-o", "pid=,stat=,args="], capture_output=True, text=True, check=True
    ).stdout
    pids = []
    for line in out.splitlines():
        pid, stat, args = line.split(None, 2)
        if "engine-sim" not in args or stat.startswith("Z"):
            continue
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            continue
        if f"{ENV_OWNER}={provisioner.engines_dir}".encode() in environ.split(b"\0"):
            pids.append(int(pid))
    return sorted(pids)


def kill_engine(provisioner: LocalProvisioner, name: str) -> int:
    """SIGKILL one engine behind the provisioner's back (a crash); its pid."""
    pid = int(provisioner.running()[name].detail["pid"])
    os.killpg(pid, signal.SIGKILL)
    return pid


def group_gone(pgid: int) -> bool:
    """No process of the process group ``pgid`` is alive (zombies aside: reaped soon)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    out = subprocess.run(
        ["ps", "-o", "stat=", "-g", str(pgid)], capture_output=True, text=True, check=False
    ).stdout.split()
    return all(stat.startswith("Z") for stat in out)
