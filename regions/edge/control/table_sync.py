"""Table sync with the control plane: fetch, verify, apply, persist; and heartbeats.

Low rate, off the hot path: httpx (async) long-polls ``GET /api/v1/edges/{region}/routing-table
?wait=25`` with ``If-None-Match``; every document is checked with
:func:`regions.tables.signing.verify` against the key ring, must list its tenants (``tenants:
null`` turns admission off, which only file mode may do) and must be for this region with a
version above the one in use, else it is refused (log + ``fedinfer_edge_table_rejections``)
and the old table keeps serving. At start, a control-plane table older than the persisted one
is refused too (a rollback, or a control plane restored from an old backup). A good table is
applied in one synchronous step and then persisted (temporary file, fsync, rename, fsync of the
folder), so the edge starts from it when the control plane is down (static stability). Errors
back off exponentially with full jitter. Heartbeats report the applied version and each
instance's health and load (``docs/distribution.md``). See ``docs/edge-federation.md``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import httpx
import orjson

from regions.tables.schema import RoutingTable, TableError, check_successor
from regions.tables.signing import verify

log = logging.getLogger("fedinfer.edge.sync")

PERSISTED_NAME = "routing-table.json"


@dataclass(frozen=True, slots=True)
class SyncConfig:
    control_plane: str
    credential: str
    keys: Mapping[str, str]
    state_dir: Path
    edge_name: str | None = None
    wait_s: int = 25
    heartbeat_s: float = 5.0
    backoff_base_s: float = 0.5
    backoff_max_s: float = 30.0
    timeout_s: float = 10.0
    #: How long a first start without a persisted table keeps trying the control plane.
    initial_timeout_s: float = 60.0

    @property
    def persisted_path(self) -> Path:
        return self.state_dir / PERSISTED_NAME

    def table_url(self, region: str) -> str:
        return f"{self.control_plane.rstrip('/')}/api/v1/edges/{region}/routing-table"

    def heartbeat_url(self) -> str:
        return f"{self.control_plane.rstrip('/')}/api/v1/edges/{self.edge_name}/heartbeat"

    def usage_url(self) -> str:
        return f"{self.control_plane.rstrip('/')}/api/v1/edges/{self.edge_name}/usage"

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.credential}"}


def backoff_delay(attempt: int, base_s: float, max_s: float, rand: Callable[[], float]) -> float:
    """Full jitter: uniform in ``[0, min(max, base * 2**attempt)]`` (attempt counts from 0)."""
    ceiling = min(max_s, base_s * (1 << min(attempt, 30)))
    return ceiling * rand()


def accept_table(
    data: bytes, keys: Mapping[str, str], current: RoutingTable | None, *, region: str
) -> RoutingTable:
    """Verify the signature, decode strictly, and check it may replace ``current``.

    A table without a tenant list is refused: it would accept any API key, and one slip of the
    control plane (or a document signed before admission existed) must not open the region.
    """
    table = verify(data, keys)
    if table.tenants is None:
        raise TableError(
            "table has no tenant list (tenants: null, admission off): only file mode may "
            "serve without admission"
        )
    check_successor(current, table, region=region)
    return table


def persist_table(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically and durably (temp + fsync + rename + dir fsync).
    The table holds tenants' key hashes and cache salts: the file is 0600, and a state
    directory this creates 0700."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        view = memoryview(data)
        while view:
            written = os.write(fd, view)
            view = view[written:]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def load_persisted(path: Path, keys: Mapping[str, str], *, region: str) -> RoutingTable | None:
    """The persisted last good table, verified again; None when absent or no longer valid."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        log.warning("persisted routing table %s unreadable: %s", path, exc)
        return None
    try:
        return accept_table(data, keys, None, region=region)
    except TableError as exc:
        log.warning("persisted routing table %s refused: %s", path, exc)
        return None


def initial_table(
    cfg: SyncConfig, region: str, rand: Callable[[], float] = random.random
) -> RoutingTable:
    """The table to start with: the control plane's if it answers, else the persisted one.

    A control-plane table older than the persisted one is refused with a warning and the
    persisted one used: versions never go back, whoever serves the old document. Without a
    persisted table the control plane is retried (backoff with jitter) for up to
    ``initial_timeout_s``; then :class:`TableError` (there is nothing to serve).
    """
    persisted = load_persisted(cfg.persisted_path, cfg.keys, region=region)
    deadline = time.monotonic() + cfg.initial_timeout_s
    attempt = 0
    with httpx.Client(timeout=min(cfg.timeout_s, 3.0)) as client:
        while True:
            answer = _first_table(client, cfg, region, persisted)
            if not isinstance(answer, str):
                return answer
            problem = answer
            if persisted is not None:
                log.warning(
                    "%s; starting from the persisted table version %s", problem, persisted.version
                )
                return persisted
            if time.monotonic() >= deadline:
                raise TableError(f"no routing table: {problem}, and none persisted")
            delay = backoff_delay(attempt, cfg.backoff_base_s, min(cfg.backoff_max_s, 5.0), rand)
            log.warning("%s; retrying in %.1fs (no persisted table)", problem, delay)
            time.sleep(max(0.05, min(delay, deadline - time.monotonic())))
            attempt += 1


def _first_table(
    client: httpx.Client, cfg: SyncConfig, region: str, persisted: RoutingTable | None
) -> RoutingTable | str:
    """One request for the table to start with: that table, or what went wrong. A refusal of
    this edge's credential is :class:`TableError` at once (retrying will not help)."""
    headers = cfg.headers()
    if persisted is not None:
        headers["If-None-Match"] = f'"{persisted.version}"'
    try:
        resp = client.get(cfg.table_url(region), headers=headers)
    except httpx.HTTPError as exc:
        return f"control plane unreachable: {exc.__class__.__name__}: {exc}"
    if resp.status_code == 304 and persisted is not None:
        return persisted
    if resp.status_code in (401, 403, 404):
        raise TableError(
            f"control plane refused the table request ({resp.status_code}): {resp.text[:200]}"
        )
    if resp.status_code != 200:
        return f"control plane answered {resp.status_code}"
    try:
        table = accept_table(resp.content, cfg.keys, None, region=region)
    except TableError as exc:
        return f"table refused: {exc}"
    if persisted is None or table.version > persisted.version:
        persist_table(cfg.persisted_path, resp.content)
        return table
    if table.version == persisted.version:
        return persisted
    return (
        f"table refused: the control plane's version {table.version} is older than the "
        f"persisted {persisted.version} (a rollback, or a stale control plane)"
    )


class SyncTarget(Protocol):
    """What the sync needs of the edge (kept as a protocol: no import of the ASGI app)."""

    @property
    def table(self) -> RoutingTable: ...

    def install_table(self, table: RoutingTable) -> None: ...

    def table_rejected(self, reason: str) -> None: ...

    def heartbeat_document(self) -> dict[str, Any]: ...


class TableSync:
    """The two background loops: long-poll for tables, and heartbeats."""

    def __init__(
        self,
        cfg: SyncConfig,
        region: str,
        target: SyncTarget,
        rand: Callable[[], float] = random.random,
    ) -> None:
        self.cfg = cfg
        self.region = region
        self.target = target
        self.rand = rand
        self.errors = 0
        self.last_error = ""
        self._beat_now: asyncio.Event | None = None

    def beat_now(self) -> None:
        """Send the next heartbeat at once (a cold model got its first request)."""
        if self._beat_now is not None:
            self._beat_now.set()

    def offer(self, data: bytes) -> bool:
        """Apply ``data`` if it verifies and advances; persist it. False when refused."""
        try:
            table = accept_table(data, self.cfg.keys, self.target.table, region=self.region)
        except TableError as exc:
            log.warning(
                "routing table refused, keeping version %s: %s", self.target.table.version, exc
            )
            self.target.table_rejected(str(exc))
            return False
        self.target.install_table(table)
        try:
            persist_table(self.cfg.persisted_path, data)
        except OSError as exc:
            # Serving goes on; only a restart without the control plane would miss it.
            log.error("routing table version %s not persisted: %s", table.version, exc)
        log.info(
            "routing table version %s applied (%d instances)", table.version, len(table.instances)
        )
        return True

    async def fetch_once(self, client: httpx.AsyncClient, wait_s: int) -> float:
        """One long-poll; returns how long to pause before the next (0: go on at once)."""
        cfg = self.cfg
        headers = cfg.headers()
        headers["If-None-Match"] = f'"{self.target.table.version}"'
        params = {"wait": str(wait_s)} if wait_s > 0 else None
        try:
            resp = await client.get(
                cfg.table_url(self.region),
                headers=headers,
                params=params,
                timeout=cfg.timeout_s + wait_s,
            )
        except httpx.HTTPError as exc:
            return self._failed(f"unreachable: {exc.__class__.__name__}: {exc}")
        status = resp.status_code
        if status == 304:
            self.errors = 0
            return 0.0
        if status == 200:
            if self.offer(resp.content):
                self.errors = 0
                return 0.0
            # The control plane would hand the same refused document back at once.
            return self._failed("table refused")
        if status == 503:
            retry = resp.headers.get("retry-after", "")
            self.last_error = "no table published yet"
            return float(retry) if retry.isdigit() else 1.0
        return self._failed(f"control plane answered {status}: {resp.text[:200]}")

    def _failed(self, reason: str) -> float:
        delay = backoff_delay(
            self.errors, self.cfg.backoff_base_s, self.cfg.backoff_max_s, self.rand
        )
        self.errors += 1
        self.last_error = reason
        log.warning("table sync: %s; retry in %.2fs", reason, delay)
        return delay

    async def fetch_loop(self, client: httpx.AsyncClient) -> None:
        while True:
            pause = await self.fetch_once(client, self.cfg.wait_s)
            if pause > 0:
                await asyncio.sleep(pause)

    async def heartbeat_once(self, client: httpx.AsyncClient) -> bool:
        body = orjson.dumps(self.target.heartbeat_document())
        headers = self.cfg.headers()
        headers["Content-Type"] = "application/json"
        try:
            resp = await client.post(
                self.cfg.heartbeat_url(), content=body, headers=headers, timeout=self.cfg.timeout_s
            )
        except httpx.HTTPError as exc:
            log.warning("heartbeat failed: %s: %s", exc.__class__.__name__, exc)
            return False
        if resp.status_code != 200:
            log.warning("heartbeat refused (%s): %s", resp.status_code, resp.text[:200])
            return False
        return True

    async def heartbeat_loop(self, client: httpx.AsyncClient) -> None:
        self._beat_now = asyncio.Event()
        while True:
            self._beat_now.clear()
            await self.heartbeat_once(client)
            # A little jitter keeps a fleet of edges from beating in lockstep.
            pause = self.cfg.heartbeat_s * (0.9 + 0.2 * self.rand())
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(pause):
                    await self._beat_now.wait()
