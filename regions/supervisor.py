"""Local processes: free ports, start with a log file, wait until ready, stop for good.

Everything that runs fedinfer's processes on one machine goes through here: ``fedinfer demo``,
the integration tests, the benchmarks, and a local provisioner starting ``fedinfer engine-sim``
or vLLM. Each child leads its own session (process group), so stopping it also stops what it
spawned (uvicorn and Celery workers, vLLM's engine core) and nothing outlives the supervisor.
Standard library only: this is the region half, which never imports the control plane.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import IO

LOOPBACK = "127.0.0.1"
#: How long a process has between SIGTERM and SIGKILL.
DEFAULT_GRACE_S = 10.0
#: Loopback readiness checks never go through an HTTP proxy of the environment.
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))
_CLK_TCK = os.sysconf("SC_CLK_TCK")


#: prctl(2) option: the signal the calling process gets when its parent dies.
_PR_SET_PDEATHSIG = 1


def die_with_parent(parent: int, sig: int = signal.SIGTERM) -> None:
    """Have Linux send this process ``sig`` when its parent (pid ``parent``, taken before the
    fork) dies, so that a parent killed outright (SIGKILL, the OOM killer) leaves no orphan. A
    parent that died before this call could ask gets the same answer at once: ``sig`` now."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0) != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"prctl(PR_SET_PDEATHSIG): {os.strerror(errno)}")
    if os.getppid() != parent:
        os.kill(os.getpid(), sig)


class StartupError(RuntimeError):
    """What was awaited did not happen: a watched process exited, or the time ran out."""


#: Ports handed out stay reserved this long, machine-wide, so two processes picking at once
#: never get the same one before either has bound it.
PORT_HOLD_S = 120.0
_PORT_LEDGER = Path(tempfile.gettempdir()) / "fedinfer-ports.json"
_port_lock = threading.Lock()


def free_port(host: str = LOOPBACK) -> int:
    """A TCP port free on ``host`` now and not handed to anyone else for :data:`PORT_HOLD_S`.

    A port the OS picks (bind to 0) lies in the ephemeral range, where any outgoing connection
    can take it between our close and the child's bind: a demo edge once failed with "address
    already in use" that way. So ports come from below the ephemeral range, and a small ledger
    under a file lock keeps parallel pickers (tests, workers' provisioners) apart.
    """
    return free_ports(1, host)[0]


def free_ports(count: int, host: str = LOOPBACK) -> list[int]:
    """``count`` consecutive free ports (the simulator serves its engines on consecutive ports)."""
    low, high = _reservable_range()
    with _port_lock, _PORT_LEDGER.open("a+") as ledger:
        fcntl.flock(ledger, fcntl.LOCK_EX)
        ledger.seek(0)
        now = time.time()
        held = {int(port): at for port, at in _read_ledger(ledger.read()).items()}
        held = {port: at for port, at in held.items() if now - at < PORT_HOLD_S}
        for _ in range(200):
            base = random.randrange(low, high - count)
            ports = list(range(base, base + count))
            if any(port in held for port in ports):
                continue
            if all(_bindable(host, port) for port in ports):
                held.update(dict.fromkeys(ports, now))
                ledger.seek(0)
                ledger.truncate()
                ledger.write(json.dumps({str(port): at for port, at in held.items()}))
                ledger.flush()
                return ports
    raise RuntimeError(f"no {count} consecutive free ports found on {host} in {low}-{high}")


def _read_ledger(text: str) -> dict[str, float]:
    try:
        data = json.loads(text or "{}")
    except ValueError:  # a ledger cut short by a killed writer is just forgotten
        return {}
    return data if isinstance(data, dict) else {}


def _reservable_range() -> tuple[int, int]:
    """Ports below the kernel's ephemeral range (outgoing connections never use them)."""
    try:
        first, _ = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        first = 32768
    if first < 12_000:
        raise RuntimeError(
            f"the ephemeral port range starts at {first}: too low to pick listening ports "
            "outside it; raise net.ipv4.ip_local_port_range"
        )
    return 10_000, first


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
        return True


class Process:
    """A child started by :func:`start_process` (or a :class:`Supervisor`): leader of its own
    process group, output in ``log``. It answers like a ``Popen`` (``pid``, ``poll``, ``wait``,
    ``send_signal``)."""

    def __init__(self, name: str, popen: subprocess.Popen[bytes], log: Path) -> None:
        self.name = name
        self.popen = popen
        self.log = log

    def __repr__(self) -> str:
        return f"<Process {self.name} pid={self.pid} returncode={self.returncode}>"

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def returncode(self) -> int | None:
        return self.popen.returncode

    def poll(self) -> int | None:
        return self.popen.poll()

    def wait(self, timeout: float | None = None) -> int:
        return self.popen.wait(timeout)

    def send_signal(self, sig: int) -> None:
        self.popen.send_signal(sig)

    def output(self) -> str:
        """Everything the process wrote so far (stdout and stderr)."""
        try:
            return self.log.read_text(errors="replace")
        except OSError:
            return ""

    def tail(self, lines: int = 30) -> str:
        return "\n".join(self.output().splitlines()[-lines:])

    def cpu_seconds(self) -> float:
        """User and system CPU time of the process and its reaped children (from /proc)."""
        try:
            stat = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return float("nan")
        return sum(int(x) for x in stat[11:15]) / _CLK_TCK

    def terminate_group(self) -> None:
        """SIGTERM the process group, unless its leader has exited already."""
        if self.popen.poll() is None:
            self._signal_group(signal.SIGTERM)

    def reap(self, deadline: float) -> int:
        """Wait for the leader until ``deadline`` (monotonic), then SIGKILL the group; either
        way kill what of the group outlived its leader. Returns the leader's exit code."""
        try:
            code = self.popen.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self._signal_group(signal.SIGKILL)
            code = self.popen.wait()
        self._signal_group(signal.SIGKILL)
        return code

    def stop(self, grace_s: float = DEFAULT_GRACE_S) -> int:
        """SIGTERM the group, SIGKILL it after ``grace_s``; returns the exit code."""
        self.terminate_group()
        return self.reap(time.monotonic() + grace_s)

    def _signal_group(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, sig)


class Supervisor:
    """The processes of one run: each started with its log ``<log_dir>/<name>.log`` (a restart
    under the same name appends to it), all stopped, newest first, when the run ends."""

    def __init__(
        self, log_dir: Path, *, cwd: Path | None = None, grace_s: float = DEFAULT_GRACE_S
    ) -> None:
        self.log_dir = log_dir
        self.cwd = cwd
        self.grace_s = grace_s
        #: Running (or exited but not yet stopped) processes, oldest first.
        self.processes: list[Process] = []
        self._logs_started: set[str] = set()

    def __enter__(self) -> Supervisor:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop_all()

    def start(
        self,
        name: str,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cpus: Iterable[int] | None = None,
        echo: Callable[[str], None] | None = None,
    ) -> Process:
        """Start ``argv`` as ``name`` (see :func:`start_process`) and supervise it."""
        process = start_process(
            name,
            argv,
            log=self.log_dir / f"{name}.log",
            append=name in self._logs_started,
            env=env,
            cwd=self.cwd,
            cpus=cpus,
            echo=echo,
        )
        self._logs_started.add(name)
        self.processes.append(process)
        return process

    def output(self, name: str) -> str:
        """The log of the process(es) started as ``name``."""
        return (self.log_dir / f"{name}.log").read_text(errors="replace")

    def exited(self) -> list[Process]:
        """The processes that exited on their own (not stopped by the supervisor)."""
        return [p for p in self.processes if p.poll() is not None]

    def stop(self, process: Process) -> int:
        """Stop one process and forget it; returns its exit code."""
        code = process.stop(self.grace_s)
        if process in self.processes:
            self.processes.remove(process)
        return code

    def stop_all(self) -> None:
        """SIGTERM every process, newest first (clients before the servers they use), then
        give them one shared grace period before SIGKILL."""
        stopping = list(reversed(self.processes))
        for process in stopping:
            process.terminate_group()
        deadline = time.monotonic() + self.grace_s
        for process in stopping:
            process.reap(deadline)
        self.processes.clear()


def start_process(
    name: str,
    argv: Sequence[str],
    *,
    log: Path,
    append: bool = False,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
    cpus: Iterable[int] | None = None,
    echo: Callable[[str], None] | None = None,
) -> Process:
    """Start ``argv`` in its own session, stdout and stderr to ``log`` (truncated unless
    ``append``). ``env`` is its whole environment (default: ours); Python children write
    unbuffered, so a log's tail is current when an error quotes it. ``cpus`` pins it (to
    those of them this process may use); with ``echo`` each line of its output also goes
    there. The caller stops it (:meth:`Process.stop`), or a :class:`Supervisor` does."""
    log.parent.mkdir(parents=True, exist_ok=True)
    pinned = _usable(cpus)
    with log.open("ab" if append else "wb") as out:
        popen = subprocess.Popen(
            list(argv),
            stdout=out if echo is None else subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=cwd,
            env={**(os.environ if env is None else env), "PYTHONUNBUFFERED": "1"},
            start_new_session=True,
            preexec_fn=None if pinned is None else lambda: os.sched_setaffinity(0, pinned),
        )
    if echo is not None:
        assert popen.stdout is not None
        threading.Thread(target=_tee, args=(popen.stdout, log, echo), daemon=True).start()
    return Process(name, popen, log)


def _usable(cpus: Iterable[int] | None) -> set[int] | None:
    """The requested CPUs this process may use; ``None`` (no pinning) when none are."""
    if cpus is None:
        return None
    usable = set(cpus) & os.sched_getaffinity(0)
    return usable or None


def _tee(source: IO[bytes], log: Path, echo: Callable[[str], None]) -> None:
    with log.open("ab") as out:
        for line in source:
            out.write(line)
            out.flush()
            echo(line.decode(errors="replace").rstrip("\n"))


def wait_until(
    ready: Callable[[], bool],
    *,
    what: str,
    timeout: float = 30.0,
    watch: Process | Iterable[Process] = (),
    interval: float = 0.1,
) -> float:
    """Poll ``ready()`` until it holds; returns the seconds it took. Raises
    :class:`StartupError` as soon as a watched process exits, or after ``timeout``, with the
    tail of the process's log."""
    watched = [watch] if isinstance(watch, Process) else list(watch)
    started = time.monotonic()
    while True:
        for process in watched:
            if process.poll() is not None:
                raise StartupError(
                    f"{process.name} exited with code {process.returncode} while waiting for "
                    f"{what}; the end of {process.log}:\n{process.tail()}"
                )
        if ready():
            return time.monotonic() - started
        if time.monotonic() - started > timeout:
            tails = "".join(f"\nthe end of {p.log}:\n{p.tail()}" for p in watched)
            raise StartupError(f"{what}: not ready within {timeout:.0f}s{tails}")
        time.sleep(interval)


def file_written(path: Path) -> bool:
    """``path`` exists and is not empty: a ready file (``engine-sim --ready-file``) is written
    in one go once every engine listens."""
    return path.exists() and path.stat().st_size > 0


def http_status(url: str, timeout: float = 1.0) -> int | None:
    """The status ``url`` answers a GET with; ``None`` when nothing answers."""
    try:
        with _DIRECT.open(url, timeout=timeout) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return exc.code
    except (urllib.error.URLError, OSError):
        return None


def wait_http(
    url: str,
    *,
    timeout: float = 30.0,
    watch: Process | Iterable[Process] = (),
    ready: Callable[[int], bool] = lambda status: status < 500,
    interval: float = 0.1,
) -> float:
    """Poll ``url`` until its status is ``ready`` (any answer but a server error, by default);
    see :func:`wait_until` for the errors."""

    def answers() -> bool:
        status = http_status(url)
        return status is not None and ready(status)

    return wait_until(answers, what=url, timeout=timeout, watch=watch, interval=interval)
