"""``fedinfer edge --workers N``: N edge processes on one port, the kernel spreading new
connections over them (``SO_REUSEPORT``).

An edge process runs on one core (one event loop); a machine with more cores serves more by
running several workers than by running several edges behind a second balancer. Each worker is
a whole edge — its own table sync, probes, scrapes and operator listener (``--operator-port``
plus its index) — and the workers keep one view the way a region's edges do: over the region's
Redis (``--peer-redis-url``, required), each a member of peer sync (``peer_load.py``). To the
control plane each worker is a holder of its own (``lease_holder``): budget leases, usage
records and a share of every rate limit; the edge stays one registered edge.

The parent only supervises. It holds the port (so it stays the edge's while a worker restarts),
forwards SIGTERM and SIGINT to the workers (each drains as a lone edge does) and restarts one
that dies, after 1 s doubling to 30 s. A worker that fails before it ever served stops the
whole edge: its settings are wrong, not its luck. Connections a dead worker had accepted, or
that waited in its listen queue, are lost with it: the kernel does not hand them to another.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import signal
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from multiprocessing.connection import wait
from multiprocessing.synchronize import Event
from types import FrameType

from regions.edge.config import EdgeConfig
from regions.supervisor import die_with_parent

log = logging.getLogger("fedinfer.edge.workers")

#: Pause before restarting a worker that died: doubling from the first to the second.
RESTART_S = (1.0, 30.0)
#: A worker that ran this long before it died is restarted after the shortest pause again.
STEADY_S = 60.0

#: ``start(worker, ready)`` runs one worker in its process; it calls ``ready()`` once serving.
StartWorker = Callable[[int, Callable[[], None]], None]


def worker_config(cfg: EdgeConfig, worker: int, workers: int) -> EdgeConfig:
    """Worker ``worker``'s settings: its place among the workers, and for all but the first a
    state and spool directory of its own (``worker-<n>`` inside the edge's), so that an edge
    that ran alone keeps its persisted table and unshipped usage as worker 0."""
    if worker == 0:
        return replace(cfg, worker=0, workers=workers)
    own = f"worker-{worker}"
    sync = cfg.sync and replace(cfg.sync, state_dir=cfg.sync.state_dir / own)
    metering = cfg.metering and replace(cfg.metering, spool_dir=cfg.metering.spool_dir / own)
    return replace(cfg, worker=worker, workers=workers, sync=sync, metering=metering)


def reserve_port(host: str, port: int) -> socket.socket:
    """A socket bound to the public address with ``SO_REUSEPORT``, never listening: the
    workers bind beside it. A port another program holds fails here, once and clearly; port 0
    becomes one port for all the workers; and the port stays the edge's while one restarts.

    ``SO_REUSEADDR`` too, as asyncio's listeners set it: a ``SO_REUSEPORT`` bind alone
    conflicts with every connection left on the port (TIME_WAIT, closing) by a listener without
    ``SO_REUSEPORT`` — an edge of one process, asyncio's default — so the edge could not bind
    its own port for a minute after such a restart. A listening socket still refuses it."""
    family, kind, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    return sock


@dataclass(slots=True)
class _Worker:
    index: int
    process: multiprocessing.process.BaseProcess
    ready: Event
    started: float = field(default_factory=time.monotonic)
    #: Its exit was dealt with (restart scheduled, or counted while stopping).
    handled: bool = False


class WorkerPool:
    """Runs ``count`` workers and keeps them running until told to stop (:meth:`run`)."""

    def __init__(self, count: int, start: StartWorker) -> None:
        self.count = count
        self.start = start
        self.context = multiprocessing.get_context("fork")
        self.workers: dict[int, _Worker] = {}
        #: Workers that have served at least once (a later failure to start is bad luck).
        self.served: set[int] = set()
        self.pause = dict.fromkeys(range(count), RESTART_S[0])
        self.restart_at: dict[int, float] = {}
        self.stopping = False
        self.status = 0

    def run(self) -> int:
        """Start the workers and supervise them until a signal stops them; 0 when they all
        stopped cleanly then, 1 when one did not or one failed before it ever served."""
        previous = {
            sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGTERM, signal.SIGINT)
        }
        try:
            for index in range(self.count):
                self._spawn(index)
            log.info("edge running %d workers", self.count)
            while not (self.stopping and all(w.handled for w in self.workers.values())):
                self._wait()
                self._reap(time.monotonic())
                self._restart_due(time.monotonic())
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        return self.status

    def stop(self, sig: int = signal.SIGTERM) -> None:
        """Stop every worker (each drains its requests first)."""
        self.stopping = True
        self.restart_at.clear()
        for worker in self.workers.values():
            if not worker.handled:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(worker.process.pid or 0, sig)

    def _on_signal(self, sig: int, _frame: FrameType | None) -> None:
        if not self.stopping:
            log.info("edge stopping its %d workers (%s)", self.count, signal.Signals(sig).name)
        self.stop(sig)

    def _spawn(self, index: int) -> None:
        ready = self.context.Event()
        process = self.context.Process(
            target=_worker_main,
            args=(self.start, index, ready, os.getpid()),
            name=f"edge-worker-{index}",
        )
        process.start()
        self.workers[index] = _Worker(index, process, ready)
        if self.stopping:  # a signal came while it started: it did not get the stop
            with contextlib.suppress(ProcessLookupError):
                os.kill(process.pid or 0, signal.SIGTERM)

    def _wait(self) -> None:
        running = [w.process.sentinel for w in self.workers.values() if not w.handled]
        timeout = None
        if self.restart_at:
            timeout = max(0.0, min(self.restart_at.values()) - time.monotonic())
        if running:
            wait(running, timeout)
        elif timeout:
            time.sleep(timeout)

    def _reap(self, now: float) -> None:
        for worker in self.workers.values():
            code = worker.process.exitcode
            if worker.handled or code is None:
                continue
            worker.handled = True
            if worker.ready.is_set():
                self.served.add(worker.index)
            if self.stopping:
                if code != 0:
                    self.status = 1
                    log.warning("worker %d stopped with status %s", worker.index, code)
                continue
            if worker.index not in self.served:
                log.error("worker %d exited with status %s before it served: stopping the edge",
                          worker.index, code)  # fmt: skip
                self.status = 1
                self.stop()
                continue
            if now - worker.started >= STEADY_S:
                self.pause[worker.index] = RESTART_S[0]
            pause = self.pause[worker.index]
            log.error("worker %d exited with status %s after %.0f s; restarting it in %.0f s",
                      worker.index, code, now - worker.started, pause)  # fmt: skip
            self.restart_at[worker.index] = now + pause
            self.pause[worker.index] = min(pause * 2, RESTART_S[1])

    def _restart_due(self, now: float) -> None:
        for index, at in list(self.restart_at.items()):
            if at <= now:
                del self.restart_at[index]
                self._spawn(index)


def _worker_main(start: StartWorker, index: int, ready: Event, parent: int) -> None:
    """A worker process: the parent's signal handlers undone, its death followed by ours."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_DFL)
    die_with_parent(parent)
    start(index, ready.set)
