"""What the fleet's integration tests share: a local provisioner on the test's own engines
folder, cleaned up at the end, and ``ps`` as the outside witness of what runs."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from regions.supervisor import Supervisor
from workers.provisioners.local import ENV_OWNER, LocalProvisioner


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
