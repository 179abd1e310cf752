"""Process plumbing for the benchmarks: free ports, pinned process groups, readiness, cleanup.

Every process is started in a new session (its own process group) and registered in a
:class:`ProcGroup`; leaving the ``with`` block (normally, on error or on Ctrl-C) sends SIGTERM
to each group, waits briefly, then SIGKILLs what is left. Nothing outlives a benchmark.
"""

from __future__ import annotations

import contextlib
import os
import platform
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VAR = ROOT / "var" / "bench"
PYTHON = sys.executable
CLK_TCK = os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def free_ports(n: int) -> list[int]:
    """``n`` consecutive free loopback ports (the simulator hosts engines on consecutive ports)."""
    for _ in range(50):
        base = free_port()
        if base + n > 65000:
            continue
        socks = []
        try:
            for p in range(base, base + n):
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                socks.append(s)
                s.bind(("127.0.0.1", p))
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
        return list(range(base, base + n))
    raise RuntimeError(f"no {n} consecutive free ports found")


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path

    @property
    def pid(self) -> int:
        return self.popen.pid

    def cpu_seconds(self) -> float:
        """User+system CPU time of the process and its reaped children (from /proc)."""
        try:
            fields = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return float("nan")
        return sum(int(x) for x in fields[11:15]) / CLK_TCK

    def tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


@dataclass
class ProcGroup:
    """Processes started for one benchmark; all killed (by process group) on exit."""

    logdir: Path
    procs: list[Proc] = field(default_factory=list)

    def __enter__(self) -> ProcGroup:
        if self.logdir.exists():  # keep the logs of earlier runs: move them aside
            stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(self.logdir.stat().st_mtime))
            with contextlib.suppress(OSError):
                self.logdir.rename(self.logdir.with_name(f"{self.logdir.name}.{stamp}"))
        self.logdir.mkdir(parents=True, exist_ok=True)
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_all()

    def start(
        self,
        name: str,
        argv: Sequence[str],
        *,
        cpus: set[int] | None = None,
        env: dict[str, str] | None = None,
    ) -> Proc:
        log = self.logdir / f"{name}.log"
        fh = open(log, "wb")  # noqa: SIM115 - handed to the child, closed below
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        cpus = _usable(cpus)

        def pre() -> None:
            if cpus:
                os.sched_setaffinity(0, cpus)

        try:
            popen = subprocess.Popen(
                list(argv),
                stdout=fh,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=ROOT,
                env=full_env,
                start_new_session=True,
                preexec_fn=pre,
            )
        finally:
            fh.close()
        proc = Proc(name, popen, log)
        self.procs.append(proc)
        return proc

    def stop(self, proc: Proc, timeout: float = 5.0) -> None:
        if proc.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.popen.wait(5)
        # Children that outlived their leader in the same group.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        if proc in self.procs:
            self.procs.remove(proc)

    def stop_all(self) -> None:
        for proc in list(reversed(self.procs)):
            self.stop(proc)


def _usable(cpus: set[int] | None) -> set[int] | None:
    if not cpus:
        return None
    allowed = os.sched_getaffinity(0)
    use = cpus & allowed
    return use or None


def wait_http(
    url: str,
    proc: Proc | None = None,
    timeout: float = 30.0,
    ready: Callable[[int], bool] = (200).__eq__,
) -> None:
    """Poll ``url`` until its status is ``ready`` (200 by default); fail early if ``proc`` died."""
    deadline = time.monotonic() + timeout
    last: object = None
    while time.monotonic() < deadline:
        if proc is not None and proc.popen.poll() is not None:
            raise RuntimeError(f"{proc.name} exited ({proc.popen.returncode}):\n{proc.tail()}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if ready(r.status):
                    return
                last = r.status
        except urllib.error.HTTPError as exc:
            if ready(exc.code):
                return
            last = exc.code
        except (urllib.error.URLError, OSError) as exc:
            last = exc
        time.sleep(0.1)
    tail = proc.tail() if proc else ""
    raise RuntimeError(f"{url} not ready after {timeout}s ({last})\n{tail}")


def machine_info() -> dict[str, object]:
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
