"""What the benchmarks share: where results go, the machine they ran on, and their processes.

A benchmark's processes run under a :class:`regions.supervisor.Supervisor` from
:func:`bench_processes`: leaving its ``with`` block (normally, on error or on Ctrl-C) stops
every process group. Nothing outlives a benchmark.
"""

from __future__ import annotations

import contextlib
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

from regions.supervisor import Supervisor

ROOT = Path(__file__).resolve().parents[2]
VAR = ROOT / "var" / "bench"
PYTHON = sys.executable
#: Grace between SIGTERM and SIGKILL when a benchmark's processes stop.
STOP_GRACE_S = 5.0


def http_ok(status: int) -> bool:
    """A benchmark starts measuring once a process answers 200, not just any status."""
    return status == 200


def bench_processes(logdir: Path) -> Supervisor:
    """A supervisor logging to ``logdir``; the logs of an earlier run there are moved aside
    (``<logdir>.<UTC time>``), not overwritten."""
    if logdir.exists():
        stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(logdir.stat().st_mtime))
        with contextlib.suppress(OSError):
            logdir.rename(logdir.with_name(f"{logdir.name}.{stamp}"))
    logdir.mkdir(parents=True, exist_ok=True)
    return Supervisor(logdir, cwd=ROOT, grace_s=STOP_GRACE_S)


def machine_info() -> dict[str, object]:
    """The machine and its load: a result is read against what else ran."""
    cpu_model = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    return {
        "nproc": os.cpu_count(),
        "cpus_allowed": sorted(os.sched_getaffinity(0)),
        "cpu_model": cpu_model,
        "python": platform.python_version(),
        "kernel": platform.release(),
        "loadavg": os.getloadavg(),
    }


def git_rev() -> str:
    """Short HEAD, with ``+dirty`` when ``regions/`` (the code under test) has local changes."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "regions"],
            cwd=ROOT,
            capture_output=True,
            text=True,
        )
    except OSError:
        return ""
    return out.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def fedinfer_argv(*args: str) -> list[str]:
    """``fedinfer <args>``: the venv's console script, else the same entry point via ``-c``."""
    script = Path(PYTHON).parent / "fedinfer"
    if script.exists():
        return [str(script), *args]
    return [PYTHON, "-c", "import sys; from federation.cli import main; main()", *args]
