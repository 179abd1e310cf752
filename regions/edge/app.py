"""The edge router: a bare ASGI app (no framework on the hot path) around the pure scheduler.

Per request: read and check the body, parse what routing needs, hash the prompt's blocks, ask
:func:`regions.edge.scheduler.decide`, wait at the gateway when every instance is at its cap,
forward over a pooled keep-alive connection (``upstream.py``), retry elsewhere only while
nothing has been sent to the client, then pass the response through byte for byte. Probes,
metric scrapes and table reloads run as background tasks of the same event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson
import xxhash
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from regions.edge import disagg
from regions.edge.admission import Admission, TenantState
from regions.edge.attempt import Attempt
from regions.edge.errors import EdgeError, UpstreamFailure, sse_error_event
from regions.edge.health import HealthBoard, HealthConfig, probe_loop
from regions.edge.hop import HOP_HEADER, HopVerifier, sign_hop
from regions.edge.kv_events import KvEventHub
from regions.edge.load import LoadBoard, scrape_loop
from regions.edge.observability import (
    CacheView,
    EdgeMetrics,
    child_traceparent,
    route_header,
    server_timing,
)
from regions.edge.parse import (
    ParsedRequest,
    UsageTap,
    body_usage,
    parse_request,
    with_cache_salt,
)
from regions.edge.prefix_index import (
    BLOCK_BYTES,
    BYTES_PER_TOKEN,
    PrefixIndex,
    SeenPrefixes,
    block_hashes,
)
from regions.edge.prefix_index import root_seed as _root_seed
from regions.edge.scheduler import (
    Candidate,
    Decision,
    RouteRequest,
    SchedulerConfig,
    decide,
)
from regions.edge.spill import (
    Remote,
    eligible_remotes,
    ramp_point,
    ramping,
    returning_remotes,
    spill_plan,
)
from regions.edge.sync import SyncConfig, TableSync
from regions.edge.table_file import FileStamp, file_stamp
from regions.edge.upstream import Response, UpstreamError, UpstreamPool, client_ssl_context
from regions.tables.schema import (
    Instance,
    RoutingTable,
    TableError,
    check_successor,
    decode_table,
    served_models,
)

log = logging.getLogger("fedinfer.edge")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

_JSON = b"application/json"
_SSE = b"text/event-stream"
_CHAT = "/v1/chat/completions"
_COMPLETIONS = "/v1/completions"


@dataclass(frozen=True, slots=True)
class EdgeConfig:
    region: str
    #: File mode (``--table``); None when the table comes from the control plane.
    table_path: Path | None
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    health: HealthConfig = field(default_factory=HealthConfig)
    max_body_bytes: int = 4 * 1024 * 1024
    queue_size: int = 256
    queue_timeout_s: float = 5.0
    max_retries: int = 2
    connect_timeout_s: float = 2.0
    read_timeout_s: float = 300.0
    #: PEM bundle that verifies ``https://`` engines and remote edges (None: the system CAs).
    upstream_ca_file: str | None = None
    probe_interval_s: float = 1.0
    probe_timeout_s: float = 1.0
    scrape_interval_s: float = 0.5
    #: Separate from the probe's: a busy engine's late /metrics still says it is busy.
    scrape_timeout_s: float = 2.0
    table_poll_s: float = 1.0
    block_bytes: int = BLOCK_BYTES
    bytes_per_token: float = BYTES_PER_TOKEN
    prefix_capacity: int = 200_000
    prefix_ttl_s: float = 600.0
    session_capacity: int = 100_000
    retry_after_s: int = 1
    #: Control-plane mode (``--control-plane``): table sync and heartbeats.
    sync: SyncConfig | None = None
    #: Seconds of a tenant's rate a token bucket holds (burst), see admission.py.
    rate_burst_s: float = 2.0
    #: Keys that sign and verify forwarded requests (hop.py): a verified hop is not charged
    #: against the tenant's rate limits again. Empty: hops are unsigned and charged here too.
    hop_keys: Mapping[str, bytes] = field(default_factory=dict)
    #: Spill on latency only when the local queue wait exceeds a remote's RTT by this much.
    spill_margin_s: float = 0.05


class _Exchange:
    """Per-request flags shared with the disconnect watcher.

    ``complete`` is set just before the last body message: the server reports a disconnect once
    the response is complete, which must not cancel the request's bookkeeping.
    """

    __slots__ = ("complete", "disconnected", "salt", "sent", "used_tokens", "view")

    def __init__(self) -> None:
        self.disconnected = False
        self.sent = False
        self.complete = False
        #: Prompt + completion tokens the engine reported (None: unknown, e.g. a cut stream).
        self.used_tokens: int | None = None
        #: The tenant's salt for :class:`SeenPrefixes` (None: no tenants, show everything).
        self.salt: int | None = None
        #: What the route header may show this tenant of the prefix cache.
        self.view: CacheView | None = None


class _Waiter:
    """A request waiting at the gateway; stays in its line until it has decided."""

    __slots__ = ("freed", "fut", "target")

    def __init__(self) -> None:
        self.fut: asyncio.Future[None] | None = None
        #: The instance it waits for (None: any instance of the model).
        self.target: str | None = None
        #: The instance whose freed slot woke it.
        self.freed: str | None = None


def _blocked(line: deque[_Waiter], inst_id: str, me: _Waiter | None) -> bool:
    """Would taking a slot of ``inst_id`` now overtake someone ahead waiting for it?"""
    for w in line:
        if w is me:
            return False
        if w.target is None or w.target == inst_id:
            return True
    return False


_SATURATED = Decision(None, None, "saturated")
_SPILL = Decision(None, None, "spill")


class _Spill:
    """What forwarding to another region needs of one request (only built when it may)."""

    __slots__ = ("allowed", "authorization", "point", "remotes", "session", "targets", "why")

    def __init__(
        self,
        remotes: tuple[Remote, ...],
        allowed: frozenset[str] | None,
        authorization: bytes | None,
        session: bytes | None,
        point: float = 0.0,
    ) -> None:
        self.remotes = remotes
        self.allowed = allowed
        self.authorization = authorization
        self.session = session
        #: The request's place for regions coming back (``spill.ramp_point``).
        self.point = point
        #: Set by the first decision when it forwards: where to, and why.
        self.targets: list[Remote] = []
        self.why = ""


class _ClientGone(Exception):
    """The client disconnected while sending its request body."""


class Edge:
    """One region's edge router; an ASGI application (``await edge(scope, receive, send)``).

    Its server (``server.py``) calls :meth:`startup` before serving and :meth:`shutdown` after.
    """

    def __init__(self, cfg: EdgeConfig, table: RoutingTable) -> None:
        self.cfg = cfg
        self.metrics = EdgeMetrics()
        self.health = HealthBoard(cfg.health, on_eject=self._on_eject)
        self.loads = LoadBoard(cfg.scrape_timeout_s)
        self.prefix = PrefixIndex(cfg.prefix_capacity, cfg.prefix_ttl_s)
        self.seen = SeenPrefixes(cfg.prefix_capacity)
        self.prefill_rates: dict[str, float] = {}
        #: Session key (:func:`_session_key`) → instance; at most ``session_capacity`` entries
        #: of a fixed size, whatever the clients send.
        self.sessions: OrderedDict[int, str] = OrderedDict()
        self.block_tokens = cfg.block_bytes / cfg.bytes_per_token
        self.kv_events = KvEventHub(self.prefix, self.block_tokens, self.metrics.registry)
        self.turn = 0
        self._lines: dict[str, deque[_Waiter]] = {}
        self._queued = 0
        self._targeted: dict[str, int] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._http: UpstreamPool | None = None
        self._probe_client: httpx.AsyncClient | None = None
        self._table_stamp: FileStamp | None = None
        self._table_bytes = b""
        self._seeds: dict[str, int] = {}
        self.table: RoutingTable = table
        self.by_model: dict[str, tuple[Instance, ...]] = {}
        self.instances: dict[str, Instance] = {}
        self.models_body = b""
        self.admission = Admission(cfg.region, cfg.rate_burst_s)
        self.hops = HopVerifier(cfg.hop_keys, cfg.region)
        self.spill: dict[str, tuple[Remote, ...]] = {}
        self._apply_table(table)
        self.sync = TableSync(cfg.sync, cfg.region, self) if cfg.sync is not None else None
        self._sync_client: httpx.AsyncClient | None = None
        self._beat_at = time.monotonic()
        self._beat_tokens: dict[str, int] = {}

    # ---------------------------------------------------------------- table

    def _apply_table(self, table: RoutingTable) -> None:
        """Switch to ``table`` in one step (no await: requests see old or new, never a mix)."""
        # First: it is the only step that can refuse the table (nothing changed yet).
        self.admission.load(table, time.monotonic())
        old_ids = {i.id for i in self.table.instances}
        ids = [i.id for i in table.instances]
        by_model: dict[str, list[Instance]] = {}
        for inst in table.instances:
            for name in (inst.model, *inst.adapters):
                by_model.setdefault(name, []).append(inst)
        self.health.sync(ids)
        self.loads.sync(ids)
        self.kv_events.sync(table.instances)
        for gone in old_ids - set(ids):
            self.prefix.forget_instance(gone)
        self.table = table
        self.by_model = {k: tuple(v) for k, v in by_model.items()}
        self.instances = {i.id: i for i in table.instances}
        self.prefill_rates = {i.id: i.prefill_tokens_per_s for i in table.instances}
        self.spill = spill_plan(table)
        self.ramping = ramping(table)
        now = int(time.time())
        self.models_body = orjson.dumps(
            {
                "object": "list",
                "data": [
                    {"id": m, "object": "model", "created": now, "owned_by": "fedinfer"}
                    for m in served_models(table)
                ],
            }
        )
        self.metrics.table_version.set(table.version)
        self._update_healthy_gauge()

    def install_table(self, table: RoutingTable) -> None:
        """Apply a table already checked (signature, region, version) and wake the waiters."""
        self._apply_table(table)
        self._wake_all()

    def table_rejected(self, reason: str) -> None:
        self.metrics.table_rejections.inc()

    def heartbeat_document(self) -> dict[str, Any]:
        """Heartbeat v1 (``docs/distribution.md``): applied version, health and load."""
        now = time.monotonic()
        elapsed = max(now - self._beat_at, 1e-3)
        self._beat_at = now
        previous = self._beat_tokens
        tokens: dict[str, int] = {}
        instances = []
        for inst in self.table.instances:
            health = self.health.states.get(inst.id)
            load = self.loads.get(inst.id)
            _, waiting, kv = load.snapshot()
            tokens[inst.id] = load.tokens
            sent = load.tokens - previous.get(inst.id, load.tokens)
            instances.append(
                {
                    "id": inst.id,
                    "healthy": health is not None and health.healthy,
                    "in_flight": load.inflight,
                    "queued": waiting + self._targeted.get(inst.id, 0),
                    "kv_cache_usage": min(1.0, max(0.0, kv)),
                    "tokens_per_s": round(max(0, sent) / elapsed, 3),
                }
            )
        self._beat_tokens = tokens
        return {"applied_table_version": self.table.version, "instances": instances}

    def reload_table(self, force: bool = False) -> bool:
        """Re-read the table file; a bad or non-advancing table is refused, the old one kept."""
        path = self.cfg.table_path
        if path is None:
            return False
        try:
            stamp = file_stamp(path)
            if not force and stamp == self._table_stamp:
                return False
            data = path.read_bytes()
        except OSError as exc:
            log.warning(
                "routing table %s unreadable, keeping version %s: %s", path, self.table.version, exc
            )
            self.metrics.table_rejections.inc()
            return False
        self._table_stamp = stamp
        if data == self._table_bytes:
            return False
        try:
            table = decode_table(data)
            check_successor(self.table, table, region=self.cfg.region)
        except TableError as exc:
            log.warning("routing table refused, keeping version %s: %s", self.table.version, exc)
            self.metrics.table_rejections.inc()
            self._table_bytes = data
            return False
        self._table_bytes = data
        self._apply_table(table)
        self._wake_all()
        log.info(
            "routing table version %s applied (%d instances)", table.version, len(table.instances)
        )
        return True

    def mark_loaded(self, data: bytes) -> None:
        """Remember the bytes of the initial table so an untouched file is not re-applied."""
        self._table_bytes = data
        if self.cfg.table_path is None:
            return
        try:
            self._table_stamp = file_stamp(self.cfg.table_path)
        except OSError:
            self._table_stamp = None

    async def _watch_table(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.table_poll_s)
            self.reload_table()

    def _targets(self) -> list[tuple[str, str]]:
        return [(i.id, i.url) for i in self.table.instances if i.state != "stopped"]

    # ---------------------------------------------------------------- lifecycle

    async def startup(self) -> None:
        tls = (
            client_ssl_context(self.cfg.upstream_ca_file)
            if self.cfg.upstream_ca_file is not None
            else None
        )
        self._http = UpstreamPool(
            connect_timeout_s=self.cfg.connect_timeout_s,
            read_timeout_s=self.cfg.read_timeout_s,
            ssl_context=tls,
        )
        self._probe_client = httpx.AsyncClient(
            verify=tls if tls is not None else True,
            timeout=httpx.Timeout(self.cfg.probe_timeout_s),
            limits=httpx.Limits(max_connections=64, max_keepalive_connections=64),
        )
        self._tasks = [
            asyncio.create_task(
                probe_loop(
                    self._probe_client, self.health, self._targets, self.cfg.probe_interval_s
                )
            ),
            asyncio.create_task(
                scrape_loop(
                    self._probe_client,
                    self.loads,
                    self._targets,
                    self.cfg.scrape_interval_s,
                    lambda instance: self.metrics.scrape_failures.labels(instance).inc(),
                )
            ),
        ]
        self.kv_events.start()
        if self.sync is not None:
            self._sync_client = httpx.AsyncClient(
                limits=httpx.Limits(max_connections=4, max_keepalive_connections=4)
            )
            self._tasks.append(asyncio.create_task(self.sync.fetch_loop(self._sync_client)))
            if self.sync.cfg.edge_name:
                self._tasks.append(asyncio.create_task(self.sync.heartbeat_loop(self._sync_client)))
            return
        self._tasks.append(asyncio.create_task(self._watch_table()))
        try:
            asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, self.reload_table, True)
        except (NotImplementedError, RuntimeError, ValueError):
            log.info("SIGHUP reload unavailable here; the table file is still polled")

    async def shutdown(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        await self.kv_events.stop()
        if self._http is not None:
            await self._http.close()
        if self._probe_client is not None:
            await self._probe_client.aclose()
        if self._sync_client is not None:
            await self._sync_client.aclose()
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            asyncio.get_running_loop().remove_signal_handler(signal.SIGHUP)

    # ---------------------------------------------------------------- health hooks

    def _on_eject(self, instance: str, reason: str) -> None:
        self.metrics.ejections.labels(instance).inc()
        # A restarted or failing engine has lost (or will lose) its cache: relearn it.
        self.prefix.forget_instance(instance)
        self._update_healthy_gauge()

    def _update_healthy_gauge(self) -> None:
        self.metrics.healthy_instances.set(sum(1 for s in self.health.states.values() if s.healthy))

    # ---------------------------------------------------------------- ASGI

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            await self._http_request(scope, receive, send)

    async def operator(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The operator listener's app: ``/healthz`` (what the scheduler believes about every
        instance) and ``/metrics``. Never on the public port: instance names, loads and
        per-model series are the fleet's business, not its clients'."""
        if scope["type"] != "http":
            return
        path: str = scope["path"]
        if scope["method"] != "GET":
            await self._error(send, EdgeError(405, "use GET", "method_not_allowed"))
        elif path == "/healthz":
            await self._healthz(send)
        elif path == "/metrics":
            await _respond(
                send, 200, generate_latest(self.metrics.registry), CONTENT_TYPE_LATEST.encode()
            )
        else:
            await self._error(send, EdgeError(404, f"no route for GET {path}", "not_found"))

    async def _http_request(self, scope: Scope, receive: Receive, send: Send) -> None:
        path: str = scope["path"]
        method: str = scope["method"]
        if path in (_CHAT, _COMPLETIONS):
            if method != "POST":
                await self._error(send, EdgeError(405, "use POST", "method_not_allowed"))
                return
            await self._completion(scope, receive, send, path == _CHAT)
        elif path == "/v1/models" and method == "GET":
            if self.admission.enabled:
                auth = next((v for k, v in scope["headers"] if k == b"authorization"), None)
                try:
                    self.admission.authenticate(auth, time.time())
                except EdgeError as err:
                    await self._error(send, err)
                    return
            await _respond(send, 200, self.models_body, _JSON)
        else:
            await self._error(send, EdgeError(404, f"no route for {method} {path}", "not_found"))

    async def _healthz(self, send: Send) -> None:
        """Liveness plus what the scheduler currently believes about each instance."""
        now = time.monotonic()
        instances = {}
        for inst in self.table.instances:
            health = self.health.states.get(inst.id)
            load = self.loads.get(inst.id)
            outstanding, waiting, kv = load.snapshot()
            instances[inst.id] = {
                "state": inst.state,
                "healthy": health is not None and health.healthy,
                "reason": health.reason if health is not None else "",
                "inflight": load.inflight,
                "outstanding": outstanding,
                "waiting": waiting,
                "kv_cache_usage": kv,
                "scraped_age_s": round(now - load.scraped_at, 3) if load.engine else None,
            }
        healthy = sum(1 for v in instances.values() if v["healthy"])
        body = orjson.dumps(
            {
                "status": "ok" if healthy else "degraded",
                "region": self.cfg.region,
                "table_version": self.table.version,
                "instances": len(self.table.instances),
                "healthy_instances": healthy,
                "queue_depth": self._queued,
                "table_source": "file" if self.sync is None else "control-plane",
                "sync_error": self.sync.last_error if self.sync is not None else "",
                "detail": instances,
            }
        )
        # Always 200: the edge itself is alive; restarting it would not bring engines back.
        await _respond(send, 200, body, _JSON)

    async def _error(
        self, send: Send, err: EdgeError, route: bytes | None = None, extra: list[Any] | None = None
    ) -> None:
        headers = [
            (b"content-type", _JSON),
            (b"x-fedinfer-route", route or route_header(self.cfg.region, None, 0, err.code)),
        ]
        if err.retry_after is not None:
            headers.append((b"retry-after", str(err.retry_after).encode()))
        if extra:
            headers.extend(extra)
        body = err.body()
        headers.append((b"content-length", str(len(body)).encode()))
        await send({"type": "http.response.start", "status": err.status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    # ---------------------------------------------------------------- completions

    async def _read_body(self, scope: Scope, receive: Receive) -> bytes:
        limit = self.cfg.max_body_bytes
        ctype = b""
        for name, value in scope["headers"]:
            if name == b"content-type":
                ctype = value
            elif name == b"content-length" and value.isdigit() and int(value) > limit:
                raise EdgeError(413, f"request body exceeds {limit} bytes", "body_too_large")
        if not ctype.split(b";", 1)[0].strip().lower() == _JSON:
            raise EdgeError(415, "Content-Type must be application/json", "unsupported_media_type")
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise _ClientGone
            chunk = message.get("body", b"")
            if chunk:
                size += len(chunk)
                if size > limit:
                    raise EdgeError(413, f"request body exceeds {limit} bytes", "body_too_large")
                chunks.append(chunk)
            if not message.get("more_body", False):
                break
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    async def _completion(self, scope: Scope, receive: Receive, send: Send, chat: bool) -> None:
        arrived = time.perf_counter()
        authorization: bytes | None = None
        session_hdr: bytes | None = None
        incoming_trace: str | None = None
        hop: bytes | None = None
        for name, value in scope["headers"]:
            if name == b"authorization":
                authorization = value
            elif name == b"x-session-id":
                session_hdr = value
            elif name == b"traceparent":
                incoming_trace = value.decode("latin-1")
            elif name == HOP_HEADER:
                hop = value
        hopped = hop is not None
        admission = self.admission
        tenant: TenantState | None = None
        charged = 0
        spill: _Spill | None = None
        remote_only: list[Remote] | None = None
        try:
            if admission.enabled:
                # Before the body: an unauthenticated client does not get 4 MB read for it.
                tenant = admission.authenticate(authorization, time.time())
            raw = await self._read_body(scope, receive)
            req = parse_request(raw, chat=chat, bytes_per_token=self.cfg.bytes_per_token)
            model = req.model
            session = session_hdr if session_hdr is not None else _user_bytes(req.user)
            if session is not None and len(session) > MAX_SESSION_ID_BYTES:
                raise EdgeError(
                    400,
                    f"session ids (x-session-id, or the body's 'user') may be at most "
                    f"{MAX_SESSION_ID_BYTES} bytes",
                    "invalid_session_id",
                    "user" if session_hdr is None else None,
                )
            if tenant is not None:
                admission.policy(tenant, model)
            if req.cache_salt is not None or (tenant is not None and tenant.policy.cache_salt):
                req = with_cache_salt(req, tenant.policy.cache_salt if tenant else None)
            allowed = tenant.allowed if tenant is not None else None
            # A request that already hopped is served here or refused: never forwarded again.
            remotes = () if hopped else self.spill.get(model, ())
            local_ok = tenant is None or tenant.local_allowed
            point = 0.0
            if self.ramping and remotes:
                point = ramp_point(session if session is not None else raw)
            if not local_ok or model not in self.by_model:
                remote_only = eligible_remotes(remotes, allowed, None, 0.0, point)
                if not remote_only:
                    raise self._nowhere(req, tenant, local_ok, hopped)
            elif remotes:
                # This region coming back: requests above its ramp go where they went meanwhile.
                back = (
                    returning_remotes(remotes, allowed, point, self.table.ramp)
                    if self.ramping
                    else None
                )
                if back:
                    remote_only = back
                else:
                    spill = _Spill(remotes, allowed, authorization, session_hdr, point)
            # Charged where it entered: a hop signed by a fellow edge was charged there.
            if tenant is not None and not (
                hop is not None and self.hops.verify(hop, raw, authorization) is not None
            ):
                admission.rate(tenant, req.cost_tokens, time.monotonic())
                charged = req.cost_tokens
        except EdgeError as err:
            self.metrics.count("", "", err.status)
            await self._error(send, err)
            return
        except _ClientGone:
            return

        session_key = (
            _session_key(tenant.slug if tenant is not None else "", model, session)
            if session is not None
            else None
        )
        _, traceparent = child_traceparent(incoming_trace)
        if remote_only is not None:
            if model not in self.by_model:
                why = "not_local"
            else:
                why = "residency" if not local_ok else "ramp"
            spill = _Spill(remotes, allowed, authorization, session_hdr, point)

        ex = _Exchange()
        if tenant is not None:
            ex.salt = _root_seed(tenant.slug)
        task = asyncio.current_task()
        watcher = asyncio.create_task(_watch_disconnect(receive, ex, task))
        try:
            if remote_only is not None and spill is not None:
                # A region coming back can serve the request itself when no remote answers.
                ramp = why == "ramp"
                if not await self._spill_over(
                    remote_only, why, spill, req, traceparent, arrived, 0.0, ex, send, ramp
                ):
                    await self._route_and_forward(req, session_key, traceparent, arrived, ex, send)
            else:
                await self._route_and_forward(
                    req, session_key, traceparent, arrived, ex, send, spill
                )
        except asyncio.CancelledError:
            if not ex.disconnected or task is None:
                raise
            task.uncancel()
            self.metrics.count(req.model, "", 499)
        finally:
            watcher.cancel()
            if charged and tenant is not None and ex.used_tokens is not None:
                admission.settle(tenant, charged, ex.used_tokens)

    def _candidates(
        self, model: str, hashes: list[int], now: float, own_target: str | None = None
    ) -> list[Candidate]:
        matched = self.prefix.match(hashes, time.monotonic()) if hashes else {}
        out = []
        states = self.health.states
        targeted = self._targeted
        for inst in self.by_model[model]:
            load = self.loads.get(inst.id)
            outstanding, waiting, kv = load.snapshot()
            health = states.get(inst.id)
            out.append(
                Candidate(
                    id=inst.id,
                    model=inst.model,
                    adapters=inst.adapters,
                    role=inst.role,
                    state=inst.state,
                    healthy=health is not None and health.healthy,
                    max_concurrency=inst.max_concurrency,
                    prefill_tokens_per_s=inst.prefill_tokens_per_s,
                    inflight=load.inflight,
                    outstanding=outstanding,
                    waiting=waiting,
                    kv_usage=kv,
                    pending_tokens=load.pending(now, inst.prefill_tokens_per_s),
                    mean_uncached_tokens=load.mean_uncached_tokens,
                    mean_service_s=load.mean_service_s,
                    cached_blocks=matched.get(inst.id, 0),
                    # A waiter does not count itself in the line it may leave.
                    queued=targeted.get(inst.id, 0) - (inst.id == own_target),
                )
            )
        return out

    async def _decide(
        self,
        req: ParsedRequest,
        hashes: list[int],
        sticky: str | None,
        exclude: frozenset[str],
        spill: _Spill | None = None,
        role: str = "mixed",
    ) -> tuple[Decision, float]:
        """Decide; wait at the gateway (bounded queue, deadline) while the choice has no slot.

        ``role``: which instances may take it (``prefill`` for the first hop of a
        disaggregated request, disagg.py); each role of a model has its own line.

        With ``spill`` (remote regions serve the model), the first decision also says whether
        to forward instead: the local expected queue wait exceeds a remote's RTT (+ margin), or
        nothing local can take the request. Then :data:`_SPILL` is returned and
        ``spill.targets``/``spill.why`` are set (one decision, not a second one to peek).

        A waiter targets the instance it chose (or any instance, for the baseline policies)
        and re-decides when a slot of its target frees, or every 50 ms. Nobody takes a slot
        ahead of an earlier waiter for the same instance (or for any instance), so a sustained
        load cannot starve the line into timeouts.
        """
        route = RouteRequest(
            model=req.model,
            prompt_tokens=req.prompt_tokens,
            block_tokens=self.block_tokens,
            sticky=sticky,
            role=role,
            exclude=exclude,
        )
        started = time.monotonic()
        key = _line_key(req.model, role)
        line = self._lines.get(key)
        if line is None:
            line = self._lines[key] = deque()
        waiter: _Waiter | None = None
        try:
            while True:
                now = time.monotonic()
                self.turn += 1
                own = waiter.target if waiter is not None else None
                decision = decide(
                    self._candidates(req.model, hashes, now, own),
                    route,
                    self.cfg.scheduler,
                    self.turn,
                )
                winner = decision.winner
                if spill is not None:
                    spill.targets = eligible_remotes(
                        spill.remotes,
                        spill.allowed,
                        winner.queue_s if winner is not None else None,
                        self.cfg.spill_margin_s,
                        spill.point,
                    )
                    if spill.targets:
                        spill.why = "ttft" if winner is not None else decision.reason
                        return _SPILL, now - started
                    spill = None
                target: str | None
                if winner is not None:
                    target = winner.instance
                    if not winner.wait and not _blocked(line, target, waiter):
                        return decision, now - started
                elif decision.reason == "saturated":
                    target = None  # any slot of the model (hard-cap policies)
                else:
                    return decision, now - started
                if waiter is None:
                    if self._queued >= self.cfg.queue_size:
                        return _SATURATED, now - started
                    waiter = _Waiter()
                    line.append(waiter)
                    self._queued += 1
                    self.metrics.queue_depth.inc()
                elif waiter.freed is not None:
                    # Woken for a slot this waiter did not take: hand it to the next in line.
                    self._wake_in(line, waiter.freed, after=waiter)
                self._retarget(waiter, target)
                remaining = started + self.cfg.queue_timeout_s - now
                if remaining <= 0:
                    return _SATURATED, now - started
                waiter.fut = asyncio.get_running_loop().create_future()
                waiter.freed = None
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(waiter.fut, min(remaining, 0.05))
        finally:
            if waiter is not None:
                line.remove(waiter)
                self._retarget(waiter, None)
                self._queued -= 1
                self.metrics.queue_depth.dec()

    def _retarget(self, waiter: _Waiter, target: str | None) -> None:
        counts = self._targeted
        if waiter.target is not None:
            counts[waiter.target] -= 1
        waiter.target = target
        if target is not None:
            counts[target] = counts.get(target, 0) + 1

    def _wake(self, inst: Instance) -> None:
        """A slot of ``inst`` freed: wake the first waiter that wants it."""
        for name in (inst.model, *inst.adapters):
            line = self._lines.get(_line_key(name, inst.role))
            if line and self._wake_in(line, inst.id, None):
                return

    def _wake_in(self, line: deque[_Waiter], inst_id: str, after: _Waiter | None) -> bool:
        passed = after is None
        for waiter in line:
            if not passed:
                passed = waiter is after
                continue
            fut = waiter.fut
            if (
                (waiter.target is None or waiter.target == inst_id)
                and fut is not None
                and not fut.done()
            ):
                waiter.freed = inst_id
                fut.set_result(None)
                return True
        return False

    def _wake_all(self) -> None:
        for line in self._lines.values():
            for waiter in line:
                if waiter.fut is not None and not waiter.fut.done():
                    waiter.fut.set_result(None)

    def _remember_session(self, key: int, instance: str) -> None:
        sessions = self.sessions
        if sessions.get(key) != instance:
            sessions[key] = instance
        sessions.move_to_end(key)
        if len(sessions) > self.cfg.session_capacity:
            sessions.popitem(last=False)

    async def _route_and_forward(
        self,
        req: ParsedRequest,
        session_key: int | None,
        traceparent: str,
        arrived: float,
        ex: _Exchange,
        send: Send,
        spill: _Spill | None = None,
    ) -> None:
        model = req.model
        seed = self._seeds.get(model)
        if seed is None:
            seed = self._seeds[model] = _root_seed(model)
        if req.cache_salt is not None:
            # The engine shares salted blocks only with the same salt: so does the index.
            seed = xxhash.xxh3_64_intdigest(req.cache_salt.encode(), seed=seed)
        hashes = block_hashes(req.prompt, seed, self.cfg.block_bytes)
        if ex.salt is not None:
            # Show a tenant only the cache its own prompts made (never what others sent).
            own = self.seen.depth(hashes, ex.salt) if hashes else 0
            if hashes:
                self.seen.add(hashes, ex.salt)
            ex.view = CacheView(int(own * self.block_tokens), self.prefill_rates)
        # P/D disaggregation (disagg.py): prefill and decode instances serve it in two hops.
        if await disagg.serve(self, req, hashes, traceparent, arrived, ex, send):
            return
        sticky = self.sessions.get(session_key) if session_key is not None else None
        exclude: frozenset[str] = frozenset()
        queue_s = 0.0
        retries = 0
        decision: Decision | None = None
        last_failure = ""
        first_pass = spill
        while True:
            decision, waited = await self._decide(req, hashes, sticky, exclude, first_pass)
            first_pass = None
            queue_s += waited
            if decision is _SPILL and spill is not None:
                if await self._spill_over(
                    spill.targets, spill.why, spill, req, traceparent, arrived, 0.0, ex, send, True
                ):
                    return
                continue  # every remote failed before its first byte: serve it here
            winner = decision.winner
            if winner is None:
                ex.complete = True
                await self._no_capacity(send, req, decision, retries, queue_s, last_failure)
                return
            inst_id = winner.instance
            inst = self.instances[inst_id]
            uncached = req.prompt_tokens - winner.cached_tokens
            with Attempt(self, inst, req.prompt_tokens, uncached) as attempt:
                # Speculative: after this prefill the winner holds the prompt (as SGLang does).
                if hashes:
                    self.prefix.insert(hashes, inst_id, time.monotonic())
                if session_key is not None:
                    self._remember_session(session_key, inst_id)
                try:
                    await self._forward(
                        inst, req, decision, retries, traceparent, arrived, queue_s, ex, send
                    )
                    return
                except UpstreamFailure as failure:
                    attempt.failed(failure)
                    last_failure = f"{inst_id}: {failure.reason}"
                    if retries >= self.cfg.max_retries or not failure.retry:
                        ex.complete = True
                        await self._upstream_failed(
                            send, req, decision, retries, last_failure, ex.view
                        )
                        return
                    retries += 1
                    self.metrics.retries.labels(model).inc()
                    exclude = exclude | {inst_id}
                    sticky = None

    def _nowhere(
        self, req: ParsedRequest, tenant: TenantState | None, local_ok: bool, hopped: bool
    ) -> EdgeError:
        """Why neither this region nor an allowed remote can take the request."""
        model = req.model
        if not local_ok and tenant is not None:
            allowed = ", ".join(sorted(tenant.allowed)) or "none"
            return EdgeError(
                403,
                f"Tenant {tenant.slug!r} may not be served in region {self.cfg.region}, and no "
                f"region it allows ({allowed}) can take `{model}` from here.",
                "region_not_allowed",
            )
        if hopped and model in {r.model for r in self.table.routes} | set(self.spill):
            return EdgeError(
                503,
                f"Region {self.cfg.region} has no instance of `{model}` for a forwarded request.",
                "no_local_instance",
                retry_after=self.cfg.retry_after_s,
            )
        if model in self.spill:
            # Served elsewhere, not in an allowed region now (a permanent residency refusal is
            # a 403 from the table's residency class, checked in admission).
            return EdgeError(
                503,
                f"No region this tenant may use can serve `{model}` from {self.cfg.region} now.",
                "no_allowed_region",
                retry_after=self.cfg.retry_after_s,
            )
        return EdgeError(
            404,
            f"The model `{model}` does not exist in region {self.cfg.region}.",
            "model_not_found",
            "model",
        )

    async def _spill_over(
        self,
        targets: list[Remote],
        why: str,
        spill: _Spill,
        req: ParsedRequest,
        traceparent: str,
        arrived: float,
        queue_s: float,
        ex: _Exchange,
        send: Send,
        fallback: bool = False,
    ) -> bool:
        """Forward to the first remote edge that answers before its first byte (in order).

        False (nothing sent) when every remote failed and ``fallback``: serve locally instead.
        """
        assert self._http is not None, "edge not started"
        path = _CHAT if req.chat else _COMPLETIONS
        headers = [(b"traceparent", traceparent.encode())]
        if spill.authorization is not None:
            headers.append((b"authorization", spill.authorization))
        if spill.session is not None:
            headers.append((b"x-session-id", spill.session))
        failures: list[str] = []
        tries = targets[: self.cfg.max_retries + 1]
        may_run_remotely = False  # a remote may be serving it: never send it elsewhere
        for remote in tries:
            self.metrics.spills.labels(remote.code, why).inc()
            # Signed for this remote (and this try): a value is good at one region, once.
            hop = sign_hop(
                self.cfg.hop_keys,
                self.cfg.region,
                remote.code,
                spill.authorization,
                req.body,
                _now_ms(),
            )
            t0 = time.perf_counter()
            try:
                resp = await self._http.post(
                    remote.edge_url, path, req.body, [*headers, (HOP_HEADER, hop)]
                )
            except UpstreamError as exc:
                failures.append(f"{remote.code}: {exc}")
                if not _may_retry(exc):
                    may_run_remotely = True
                    break
                continue
            connect_s = time.perf_counter() - t0
            clean = False
            try:
                if resp.status >= 500 and (remote is not tries[-1] or fallback):
                    failures.append(f"{remote.code}: status {resp.status}")
                    continue
                await self._relay(
                    resp, remote, why, req, traceparent, arrived, queue_s, connect_s, ex, send
                )
                clean = True
                return True
            except UpstreamFailure as failure:
                failures.append(f"{remote.code}: {failure.reason}")
                if not failure.retry:
                    may_run_remotely = True
                    break
            finally:
                if clean:
                    resp.release()
                else:
                    resp.close()
        log.warning("spill-over of %s failed: %s", req.model, "; ".join(failures))
        if fallback and not may_run_remotely:
            return False
        ex.complete = True
        err = EdgeError(
            502,
            "no remote region could take the request; retry later",
            "upstream_error",
            retry_after=self.cfg.retry_after_s,
        )
        self.metrics.count(req.model, "", 502)
        route = f"region={self.cfg.region};instance=none;reason=spill_failed;spill={why}".encode()
        await self._error(send, err, route)
        return True

    async def _relay(
        self,
        resp: Response,
        remote: Remote,
        why: str,
        req: ParsedRequest,
        traceparent: str,
        arrived: float,
        queue_s: float,
        connect_s: float,
        ex: _Exchange,
        send: Send,
    ) -> None:
        """Pass the remote edge's answer through; its route header gains where it came from."""
        theirs = resp.headers.get(b"x-fedinfer-route", b"").decode("latin-1") or (
            f"region={remote.code}"
        )
        head, _, rest = theirs.partition(";")
        route = f"{head};remote_from={self.cfg.region};spill={why};rtt_ms={remote.rtt_s * 1000:.0f}"
        if rest:
            route += ";" + rest
        ctype = resp.headers.get(b"content-type", _JSON)
        try:
            first = await resp.readany() if req.stream else await resp.read()
        except UpstreamError as exc:
            raise UpstreamFailure(f"read: {exc}", connect=True, retry=_may_retry(exc)) from exc
        ttft = time.perf_counter() - arrived
        headers_out = [
            (b"content-type", ctype),
            (b"x-fedinfer-route", route.encode("latin-1")),
            (b"server-timing", server_timing(queue_s, connect_s, ttft)),
            (b"traceparent", traceparent.encode()),
        ]
        retry_after = resp.headers.get(b"retry-after")
        if retry_after is not None:
            headers_out.append((b"retry-after", retry_after))
        if not req.stream:
            headers_out.append((b"content-length", str(len(first)).encode()))
        ex.sent = True
        await send({"type": "http.response.start", "status": resp.status, "headers": headers_out})
        if req.stream:
            await send({"type": "http.response.body", "body": first, "more_body": True})
            try:
                while True:
                    chunk = await resp.readany()
                    if not chunk:
                        break
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
            except UpstreamError as exc:
                self.metrics.midstream_failures.labels(f"remote:{remote.code}").inc()
                ex.complete = True
                log.warning("remote region %s failed mid-stream: %s", remote.code, exc)
                message = f"region {remote.code} failed mid-stream; the response is incomplete"
                await send(
                    {
                        "type": "http.response.body",
                        "body": sse_error_event(message, "upstream_stream_cut"),
                    }
                )
                self.metrics.count(req.model, f"remote:{remote.code}", 502)
                return
            ex.complete = True
            await send({"type": "http.response.body", "body": b""})
        else:
            ex.complete = True
            await send({"type": "http.response.body", "body": first})
            prompt, _, completion = body_usage(first)
            if prompt is not None and completion is not None:
                ex.used_tokens = prompt + completion
        self.metrics.count(req.model, f"remote:{remote.code}", resp.status)

    async def _no_capacity(
        self,
        send: Send,
        req: ParsedRequest,
        decision: Decision,
        retries: int,
        queue_s: float,
        last_failure: str,
    ) -> None:
        reason = decision.reason
        if reason == "saturated":
            msg = f"all instances of `{req.model}` are at capacity; retry later"
        elif last_failure:
            log.warning(
                "no instance of %s could serve a request (last: %s)", req.model, last_failure
            )
            msg = f"no instance of `{req.model}` could serve the request; retry later"
        else:
            msg = f"no healthy instance of `{req.model}` in region {self.cfg.region}"
        err = EdgeError(503, msg, reason, retry_after=self.cfg.retry_after_s)
        self.metrics.count(req.model, "", 503)
        timing = (b"server-timing", server_timing(queue_s, None, None))
        await self._error(send, err, route_header(self.cfg.region, None, retries, reason), [timing])

    async def _upstream_failed(
        self,
        send: Send,
        req: ParsedRequest,
        decision: Decision,
        retries: int,
        last_failure: str,
        view: CacheView | None,
    ) -> None:
        log.warning("upstream failed before responding: %s", last_failure)
        err = EdgeError(
            502,
            f"the engine serving `{req.model}` failed before responding; retry later",
            "upstream_error",
            retry_after=self.cfg.retry_after_s,
        )
        inst = decision.winner.instance if decision.winner else ""
        self.metrics.count(req.model, inst, 502)
        await self._error(send, err, route_header(self.cfg.region, decision, retries, view=view))

    async def _forward(
        self,
        inst: Instance,
        req: ParsedRequest,
        decision: Decision,
        retries: int,
        traceparent: str,
        arrived: float,
        queue_s: float,
        ex: _Exchange,
        send: Send,
        *,
        route: bytes | None = None,
        timing_extra: bytes = b"",
        upstream_headers: tuple[tuple[bytes, bytes], ...] = (),
    ) -> None:
        """Send to ``inst``, pass the answer through; :class:`UpstreamFailure` before byte one.

        ``route``/``timing_extra``: a caller with more than one hop (disagg.py's decode leg)
        says what the route header is and adds its own Server-Timing entries.
        """
        assert self._http is not None, "edge not started"
        path = _CHAT if req.chat else _COMPLETIONS
        t0 = time.perf_counter()
        try:
            resp = await self._http.post(
                inst.url,
                path,
                req.body,
                [(b"traceparent", traceparent.encode()), *upstream_headers],
            )
        except UpstreamError as exc:
            raise UpstreamFailure(str(exc), connect=True, retry=_may_retry(exc)) from exc
        connect_s = time.perf_counter() - t0
        clean = False
        try:
            status = resp.status
            if status >= 500:
                raise UpstreamFailure(f"status {status}", connect=False)
            ctype = resp.headers.get(b"content-type", _JSON)
            if req.stream and status == 200 and ctype.startswith(_SSE):
                clean = await self._pump_stream(
                    resp,
                    inst,
                    req,
                    decision,
                    retries,
                    traceparent,
                    arrived,
                    queue_s,
                    connect_s,
                    ctype,
                    ex,
                    send,
                    route=route,
                    timing_extra=timing_extra,
                )
                return
            try:
                body = await resp.read()
            except UpstreamError as exc:
                raise UpstreamFailure(f"read: {exc}", connect=True, retry=_may_retry(exc)) from exc
            ttft = time.perf_counter() - arrived
            headers_out = [
                (b"content-type", ctype),
                (b"content-length", str(len(body)).encode()),
                (
                    b"x-fedinfer-route",
                    route or route_header(self.cfg.region, decision, retries, view=ex.view),
                ),
                (b"server-timing", server_timing(queue_s, connect_s, ttft) + timing_extra),
                (b"traceparent", traceparent.encode()),
            ]
            ex.sent = True
            await send({"type": "http.response.start", "status": status, "headers": headers_out})
            ex.complete = True
            await send({"type": "http.response.body", "body": body})
            clean = True
            if status == 200:
                self.health.success(inst.id)
                prompt, cached, completion = body_usage(body)
                if prompt is not None and completion is not None:
                    ex.used_tokens = prompt + completion
                self._record(req, decision, inst.id, status, ttft, prompt, cached, arrived)
            else:
                self._record(req, decision, inst.id, status, None, None, None, arrived)
        finally:
            # A fully read response returns its connection to the pool; anything else closes
            # it, which is how the engine learns to abort the request.
            if clean:
                resp.release()
            else:
                resp.close()

    async def _pump_stream(
        self,
        resp: Response,
        inst: Instance,
        req: ParsedRequest,
        decision: Decision,
        retries: int,
        traceparent: str,
        arrived: float,
        queue_s: float,
        connect_s: float,
        ctype: bytes,
        ex: _Exchange,
        send: Send,
        *,
        route: bytes | None = None,
        timing_extra: bytes = b"",
    ) -> bool:
        """Pass the SSE stream through; True when it ended cleanly with ``[DONE]``."""
        tap = UsageTap(req.strip_usage)
        # Hold the response headers until the first bytes arrive, so a failure before then can
        # still be retried on another instance.
        first = b""
        try:
            while not first:
                chunk = await resp.readany()
                if not chunk:
                    # The engine ended the stream itself: it is not running the request.
                    raise UpstreamFailure("closed before the first byte", connect=True)
                first = tap.feed(chunk)
        except UpstreamError as exc:
            raise UpstreamFailure(f"stream: {exc}", connect=True, retry=_may_retry(exc)) from exc
        ttft = time.perf_counter() - arrived
        headers_out = [
            (b"content-type", ctype),
            (b"cache-control", b"no-cache"),
            (
                b"x-fedinfer-route",
                route or route_header(self.cfg.region, decision, retries, view=ex.view),
            ),
            (b"server-timing", server_timing(queue_s, connect_s, ttft) + timing_extra),
            (b"traceparent", traceparent.encode()),
        ]
        ex.sent = True
        await send({"type": "http.response.start", "status": 200, "headers": headers_out})
        await send({"type": "http.response.body", "body": first, "more_body": True})
        failure = ""
        try:
            while True:
                chunk = await resp.readany()
                if not chunk:
                    break
                out = tap.feed(chunk)
                if out:
                    await send({"type": "http.response.body", "body": out, "more_body": True})
        except UpstreamError as exc:
            failure = str(exc)
        if not failure and not tap.done:
            failure = "stream ended without [DONE]"
        if failure:
            self.metrics.midstream_failures.labels(inst.id).inc()
            self.health.connect_error(inst.id, f"mid-stream: {failure}")
            log.warning("instance %s failed mid-stream: %s", inst.id, failure)
            message = "the engine failed mid-stream; the response is incomplete"
            ex.complete = True
            await send(
                {
                    "type": "http.response.body",
                    "body": sse_error_event(message, "upstream_stream_cut"),
                }
            )
            self._record(req, decision, inst.id, 502, ttft, None, None, arrived)
            return False
        ex.complete = True
        await send({"type": "http.response.body", "body": tap.pending})
        if tap.prompt_tokens is not None and tap.completion_tokens is not None:
            ex.used_tokens = tap.prompt_tokens + tap.completion_tokens
        self.health.success(inst.id)
        self._record(
            req, decision, inst.id, 200, ttft, tap.prompt_tokens, tap.cached_tokens, arrived
        )
        return True

    def _record(
        self,
        req: ParsedRequest,
        decision: Decision,
        inst: str,
        status: int,
        ttft: float | None,
        prompt: int | None,
        cached: int | None,
        arrived: float,
    ) -> None:
        series = self.metrics.series(req.model, inst)
        statuses = series.statuses
        statuses[status] = statuses.get(status, 0) + 1
        if ttft is not None:
            series.ttft.observe(ttft)
        series.e2e.observe(time.perf_counter() - arrived)
        if cached is not None and decision.winner is not None:
            series.predicted_cached += decision.winner.cached_tokens
            series.actual_cached += cached
        if prompt is not None:
            series.prompt_tokens += prompt


#: Longer session ids (``x-session-id`` or the body's ``user``) are refused: they are hashed to
#: a fixed-size key, but a bound keeps what a client may make the edge hash and forward small.
MAX_SESSION_ID_BYTES = 256


def _user_bytes(user: str | None) -> bytes | None:
    return user.encode() if user is not None else None


def _session_key(tenant: str, model: str, session: bytes) -> int:
    """A fixed-size key per (tenant, model, session id): one tenant's session ids never pin
    another tenant's requests, and no client-sized string is kept in the session map."""
    return xxhash.xxh3_64_intdigest(b"%b\0%b\0%b" % (tenant.encode(), model.encode(), session))


def _may_retry(exc: UpstreamError) -> bool:
    """Another upstream may take the request: this one never got it, or dropped it itself."""
    return not exc.sent or exc.dropped


def _now_ms() -> int:
    return int(time.time() * 1000)


def _line_key(model: str, role: str) -> str:
    """The gateway line of a model (or adapter) name for instances of ``role``."""
    return model if role == "mixed" else f"{model}\0{role}"


async def _watch_disconnect(
    receive: Receive, ex: _Exchange, task: asyncio.Task[Any] | None
) -> None:
    """Cancel the request's task when the client goes away, so the upstream is closed too."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            if ex.complete:
                return
            ex.disconnected = True
            if task is not None:
                task.cancel()
            return


async def _respond(send: Send, status: int, body: bytes, ctype: bytes) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", ctype), (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})
