"""The edge router: a bare ASGI app (no framework on the hot path) that runs a request's stages.

A completion request is admitted (``admit.py``), placed and queued at the gateway
(``place.py``, ``gateway_line.py``), forwarded (``forward.py``; ``disagg.py`` for two
hops, ``spill_over.py`` to another region), relayed back byte for byte (``relay.py``) and
recorded (``record.py``), carried by one :class:`~regions.edge.stages.context.RequestContext`
(``context.py`` lists the stages). This module keeps the routing table's state, the
background work (probes, metric scrapes, table reloads, as tasks of the same event loop) and
the dispatch of requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from typing import TYPE_CHECKING, Any

import httpx
import orjson
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from regions.edge.config import EdgeConfig
from regions.edge.control.table_file import FileStamp, file_stamp
from regions.edge.control.table_sync import TableSync
from regions.edge.http.endpoints import ENDPOINTS, Endpoint
from regions.edge.http.errors import EdgeError
from regions.edge.http.server import Receive, Scope, Send
from regions.edge.http.stopping import SLOW_STOP_S, await_chain, stop_step
from regions.edge.http.upstream import UpstreamPool, client_ssl_context
from regions.edge.metering.meter import Meter, UsageCollector
from regions.edge.metering.usage_shipper import ControlPlaneSink, RedisStreamSink, UsageSink
from regions.edge.observability import EdgeMetrics
from regions.edge.policy.admission import Admission
from regions.edge.policy.budget import Budgets
from regions.edge.policy.hop import HopVerifier
from regions.edge.policy.prefix_index import PrefixIndex
from regions.edge.policy.sessions import SessionMap
from regions.edge.policy.spill import Remote, ramping, spill_plan
from regions.edge.policy.split import Split, SplitCollector, split_plan
from regions.edge.reports import Heartbeats, healthz_document
from regions.edge.stages.admit import Admit
from regions.edge.stages.attempt import Attempts
from regions.edge.stages.cold import ColdHolds
from regions.edge.stages.context import AdmitStage, RequestContext
from regions.edge.stages.disagg import PdRouter
from regions.edge.stages.forward import Forwarder
from regions.edge.stages.gateway_line import GatewayLines
from regions.edge.stages.place import Placement
from regions.edge.stages.record import CLIENT_GONE, Recorder
from regions.edge.stages.relay import JSON, Relay, respond
from regions.edge.stages.spill_over import SpillOver
from regions.edge.view.health import HealthBoard, probe_loop
from regions.edge.view.kv_events import KvEventHub
from regions.edge.view.load import LoadBoard, SpeedCollector, scrape_loop
from regions.edge.view.peer_sync import build_peer_sync
from regions.edge.view.token_prefix import TokenPrefixes
from regions.engines.prompt_tokens import load_tokenizers
from regions.tables.schema import (
    Instance,
    RoutingTable,
    TableError,
    check_successor,
    decode_table,
    served_models,
)

if TYPE_CHECKING:  # imported only when tracing is on (opentelemetry is an optional extra)
    from regions.edge.tracing import EdgeTracer

log = logging.getLogger("fedinfer.edge")


class Edge:
    """One region's edge router; an ASGI application (``await edge(scope, receive, send)``).

    Its server (``server.py``) calls :meth:`startup` before serving and :meth:`shutdown` after.
    The stages read the current table through it (:class:`~regions.edge.stages.context.Fleet`).
    """

    def __init__(self, cfg: EdgeConfig, table: RoutingTable) -> None:
        self.cfg = cfg
        self.metrics = EdgeMetrics(cfg.tenant_series)
        self.health = HealthBoard(cfg.health, on_eject=self._on_eject)
        self.loads = LoadBoard(cfg.scrape_timeout_s, cfg.scheduler.decode_slowdown)
        self.prefix = PrefixIndex(cfg.prefix_capacity, cfg.prefix_ttl_s)
        self.lines = GatewayLines(cfg.queue_size, self.metrics.queue_depth)
        self.sessions = SessionMap(cfg.session_capacity)
        self.admission = Admission(cfg.region, cfg.rate_burst_s, cfg.workers)
        self.hops = HopVerifier(cfg.hop_keys, cfg.region)
        self.cold = ColdHolds(cfg.cold, on_demand=self._beat_now)
        self._tasks: list[asyncio.Task[None]] = []
        self._http: UpstreamPool | None = None
        self._probe_client: httpx.AsyncClient | None = None
        self._table_stamp: FileStamp | None = None
        self._table_bytes = b""
        # The table's state, replaced whole by _apply_table.
        self.table: RoutingTable = table
        self.by_model: dict[str, tuple[Instance, ...]] = {}
        self.instances: dict[str, Instance] = {}
        self.prefill_rates: dict[str, float] = {}
        self.spill: dict[str, tuple[Remote, ...]] = {}
        self.splits: dict[str, Split] = {}
        self.several_edges = False
        self.ramping = False
        self.models_body = b""
        self.tenant_models_bodies: dict[str, bytes] = {}
        self.meter = _meter(cfg)
        if self.meter is not None:
            self.metrics.registry.register(UsageCollector(self.meter))
        # The stages, in a request's order.
        self.budgets = Budgets(cfg.holder)
        self.recorder = Recorder(
            self.metrics,
            self.admission,
            self.loads,
            cfg.region,
            self.meter,
            self.budgets,
            learn_speeds=cfg.learn_speeds,
        )
        self.metrics.registry.register(SpeedCollector(self.loads, lambda: self.prefill_rates))
        self.relay = Relay(cfg.region, cfg.retry_after_s, self.health, self.metrics, self.recorder)
        self.spill_over = SpillOver(cfg, self, self.relay, self.metrics, self.cold)
        self.admit = Admit(
            cfg, self.spill_over, self.admission, self.hops, self.relay, self.meter, self.budgets
        )
        self.kv_events = KvEventHub(
            self.prefix, cfg.block_bytes / cfg.bytes_per_token, self.metrics.registry
        )
        self.peer_sync = build_peer_sync(
            cfg.peer_redis_url,
            cfg.region,
            cfg.holder,
            cfg.peer_keys,
            self.loads,
            self.admission,
            self.metrics.registry,
            self,
        )
        tokenizers = load_tokenizers(dict(cfg.tokenizers), cfg.tokenize_max_chars)
        self.placement = Placement(
            cfg,
            self,
            self.health,
            self.loads,
            self.prefix,
            self.lines,
            (
                TokenPrefixes(tokenizers, self.kv_events, cfg.kv_hash_seed, self.metrics.registry)
                if tokenizers
                else None
            ),
            self.peer_sync,
        )
        self.metrics.registry.register(
            SplitCollector(cfg.region, self.placement.splits, lambda: self.splits)
        )
        attempts = Attempts(self.loads, self.health, self.metrics.inflight, self.lines)
        self.forwarder = Forwarder(
            cfg,
            self,
            self.placement,
            attempts,
            self.relay,
            self.spill_over,
            self.sessions,
            self.metrics,
        )
        self.pd = PdRouter(cfg, self, self.placement, self.forwarder)
        self.tracer = _tracer(cfg)
        #: The admit stage, behind the request's trace when tracing is on (no cost when off).
        self.admit_stage: AdmitStage = (
            self.admit if self.tracer is None else self.tracer.admitting(self.admit)
        )
        self._apply_table(table)
        self.sync = TableSync(cfg.sync, cfg.region, self) if cfg.sync is not None else None
        self._sync_client: httpx.AsyncClient | None = None
        self.heartbeats = Heartbeats()

    @property
    def upstream(self) -> UpstreamPool:
        """The pooled connections to engines and remote edges (from :meth:`startup` on)."""
        assert self._http is not None, "edge not started"
        return self._http

    # ---------------------------------------------------------------- table

    def _apply_table(self, table: RoutingTable) -> None:
        """Switch to ``table`` in one step (no await: requests see old or new, never a mix)."""
        # First: it is the only step that can refuse the table (nothing changed yet).
        self.admission.load(table, time.monotonic())
        self.budgets.load(table)
        old_ids = {i.id for i in self.table.instances}
        ids = [i.id for i in table.instances]
        by_model: dict[str, list[Instance]] = {}
        for inst in table.instances:
            for name in (inst.model, *inst.adapters):
                by_model.setdefault(name, []).append(inst)
        self.health.sync(ids)
        self.loads.sync(
            {i.id: (i.model, i.prefill_tokens_per_s) for i in table.instances},
            {i.id: i.max_concurrency for i in table.instances},
        )
        self.kv_events.sync(table.instances)
        for gone in old_ids - set(ids):
            self.prefix.forget_instance(gone)
        self.table = table
        self.by_model = {k: tuple(v) for k, v in by_model.items()}
        self.instances = {i.id: i for i in table.instances}
        self.prefill_rates = {i.id: i.prefill_tokens_per_s for i in table.instances}
        self.spill = spill_plan(table)
        self.splits = split_plan(table, self.spill, set(self.by_model))
        self.several_edges = any(r.edges for r in table.remote_regions)
        self.ramping = ramping(table)
        self.cold.load(table)
        self.cold.release(self.by_model)
        now = int(time.time())
        names = sorted({*served_models(table), *self.cold.models})
        private = table.private_adapters
        self.models_body = _models_body([m for m in names if m not in private], now)
        # A tenant allowed private adapters sees them listed; nobody else learns they exist.
        self.tenant_models_bodies = {
            slug: _models_body([m for m in names if m not in private or slug in private[m]], now)
            for slug in {s for allowed in private.values() for s in allowed}
        }
        self.metrics.table_version.set(table.version)
        self._update_healthy_gauge()

    def install_table(self, table: RoutingTable) -> None:
        """Apply a table already checked (signature, region, version) and wake the waiters."""
        self._apply_table(table)
        self.lines.wake_all()

    @property
    def cold_models(self) -> dict[str, Any]:
        return self.cold.models

    def _beat_now(self) -> None:
        if self.sync is not None:
            self.sync.beat_now()

    def table_rejected(self, reason: str) -> None:
        self.metrics.table_rejections.inc()

    def heartbeat_document(self) -> dict[str, Any]:
        return self.heartbeats.document(self)

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
        self.lines.wake_all()
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
        if self.cfg.drain_migrate_after_s is not None:
            self._tasks.append(asyncio.create_task(self.forwarder.continuation.watch_drains()))
        self.kv_events.start()
        if self.peer_sync is not None:
            self.peer_sync.start()
        if self.meter is not None:
            await self.meter.start()
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
        if self._tasks:
            # Bounded: a background loop that does not end when cancelled is a defect to see
            # in the log, not a process that never exits (a stop the supervisor then kills).
            _, stuck = await asyncio.wait(self._tasks, timeout=SLOW_STOP_S)
            for task in stuck:
                log.error("shutdown: %s did not stop when cancelled", await_chain(task))
        self._tasks = []
        await stop_step("the KV event subscriptions", self.kv_events.stop(), log)
        if self.peer_sync is not None:
            await stop_step("peer sync", self.peer_sync.stop(), log)
        if self.placement.tokens is not None:
            self.placement.tokens.close()
        if self.meter is not None:
            # Its last shipping may take a while; what it leaves stays in the spool on disk.
            await stop_step("the usage meter", self.meter.stop(), log, timeout_s=30.0)
        if self._http is not None:
            await stop_step("the upstream pool", self._http.close(), log)
        if self._probe_client is not None:
            await stop_step("the probe client", self._probe_client.aclose(), log)
        if self._sync_client is not None:
            await stop_step("the table sync client", self._sync_client.aclose(), log)
        if self.tracer is not None:
            await stop_step("the tracer", asyncio.to_thread(self.tracer.shutdown), log)
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            asyncio.get_running_loop().remove_signal_handler(signal.SIGHUP)

    def _count_tenant(self, ctx: RequestContext) -> None:
        """The tenant's series: the answer's status (499: its client left), TTFT, tokens."""
        assert ctx.tenant is not None
        status = ctx.status or (CLIENT_GONE if ctx.disconnected else 0)
        prompt, completion, cached = _tenant_tokens(ctx)
        self.metrics.tenants.observe(
            ctx.tenant.slug, status, ctx.ttft_s, prompt, completion, cached
        )

    # ---------------------------------------------------------------- health hooks

    def _on_eject(self, instance: str, reason: str) -> None:
        self.metrics.ejections.labels(instance).inc()
        # A restarted or failing engine has lost (or will lose) its cache: relearn it.
        self.prefix.forget_instance(instance)
        self._update_healthy_gauge()

    def _update_healthy_gauge(self) -> None:
        self.metrics.healthy_instances.set(sum(1 for s in self.health.states.values() if s.healthy))

    # ---------------------------------------------------------------- ASGI

    async def operator(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The operator listener's app: ``/healthz`` (what the scheduler believes about every
        instance) and ``/metrics``. Never on the public port: instance names, loads and
        per-model series are the fleet's business, not its clients'."""
        if scope["type"] != "http":
            return
        path: str = scope["path"]
        if scope["method"] != "GET":
            await self.relay.error(send, EdgeError(405, "use GET", "method_not_allowed"))
        elif path == "/healthz":
            # Always 200: the edge itself is alive; restarting it would not bring engines back.
            await respond(send, 200, orjson.dumps(healthz_document(self)), JSON)
        elif path == "/metrics":
            await respond(
                send, 200, generate_latest(self.metrics.registry), CONTENT_TYPE_LATEST.encode()
            )
        else:
            await self.relay.error(send, EdgeError(404, f"no route for GET {path}", "not_found"))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        path: str = scope["path"]
        method: str = scope["method"]
        endpoint = ENDPOINTS.get(path)
        if endpoint is not None:
            if method != "POST":
                await self.relay.error(send, EdgeError(405, "use POST", "method_not_allowed"))
                return
            await self._serve(scope, receive, send, endpoint)
        elif path == "/v1/models" and method == "GET":
            body = self.models_body
            if self.admission.enabled:
                auth = next((v for k, v in scope["headers"] if k == b"authorization"), None)
                try:
                    tenant = self.admission.authenticate(auth, time.time())
                except EdgeError as err:
                    await self.relay.error(send, err)
                    return
                body = self.tenant_models_bodies.get(tenant.slug, body)
            await respond(send, 200, body, JSON)
        else:
            await self.relay.error(
                send, EdgeError(404, f"no route for {method} {path}", "not_found")
            )

    # ---------------------------------------------------------------- requests

    async def _serve(self, scope: Scope, receive: Receive, send: Send, endpoint: Endpoint) -> None:
        """admit → (another region first?) → place, queue, forward, relay → record.

        Tokenizer calls skip the queue (any healthy instance of the model, no slot); routes
        that do not generate skip prefix hashing and P/D."""
        ctx = await self.admit_stage(scope, receive, send, endpoint)
        if ctx is None:
            return  # refused and answered, or the client left
        task = asyncio.current_task()
        watcher = asyncio.create_task(_watch_disconnect(receive, ctx, task))
        try:
            if not await self.spill_over.first(ctx):
                return
            if not endpoint.queued:
                await self.forwarder.serve_unqueued(ctx)
            elif not endpoint.generates:
                await self.forwarder.serve(ctx)
            else:
                self.placement.hash_prompt(ctx)
                if self.placement.tokens is not None:  # --tokenizer: exact prefixes
                    await self.placement.tokenize(ctx)
                # P/D disaggregation (disagg.py): prefill and decode instances serve it in two
                # hops (chat and completions: the legs are vLLM's proxy protocol).
                if endpoint.kind == "responses" or not await self.pd.serve(ctx):
                    await self.forwarder.serve(ctx)
        except asyncio.CancelledError:
            if not ctx.disconnected or task is None:
                raise
            task.uncancel()
            self.recorder.answered(ctx.req.model, "", 499)
        finally:
            watcher.cancel()
            self.recorder.finished(ctx)
            if ctx.tenant is not None:
                self._count_tenant(ctx)
            if ctx.trace is not None:
                ctx.trace.close(ctx.status, _span_facts(ctx))


def _models_body(names: list[str], now: int) -> bytes:
    """The OpenAI ``/v1/models`` answer listing ``names``."""
    return orjson.dumps(
        {
            "object": "list",
            "data": [
                {"id": m, "object": "model", "created": now, "owned_by": "fedinfer"} for m in names
            ],
        }
    )


def _meter(cfg: EdgeConfig) -> Meter | None:
    """The edge's meter with its sink: the Redis usage stream, else the control plane."""
    metering = cfg.metering
    if metering is None:
        return None
    sink: UsageSink
    if metering.redis_url is not None:
        if metering.stream_edge is None or metering.stream_key is None:
            raise ValueError("the usage stream needs the edge's name and credential")
        sink = RedisStreamSink(
            metering.redis_url, edge=metering.stream_edge, key=metering.stream_key
        )
    elif cfg.sync is not None and cfg.sync.edge_name:
        sink = ControlPlaneSink(cfg.sync.usage_url(), cfg.sync.credential)
    else:
        raise ValueError("usage metering needs a Redis URL or a control plane and an edge name")
    return Meter(metering, sink)


def _tenant_tokens(ctx: RequestContext) -> tuple[int | None, int | None, int | None]:
    """(prompt, completion, cached) tokens as the engine reported them (None: unknown)."""
    prompt, used = ctx.prompt_tokens, ctx.used_tokens
    completion = used - prompt if used is not None and prompt is not None else None
    return prompt, completion, ctx.cached_tokens


def _tracer(cfg: EdgeConfig) -> EdgeTracer | None:
    """The edge's tracer when tracing is on; opentelemetry is imported only then."""
    if cfg.tracing is None:
        return None
    from regions.edge.tracing import EdgeTracer

    return EdgeTracer(cfg.tracing, cfg.region, cfg.holder)


def _span_facts(ctx: RequestContext) -> dict[str, Any]:
    """What the request's span says once it is over (never a key or prompt text)."""
    facts: dict[str, Any] = {
        "fedinfer.retries": ctx.retries,
        "fedinfer.queue_ms": ctx.queue_s * 1000.0,
        "fedinfer.client_gone": ctx.disconnected and not ctx.complete,
    }
    if ctx.served_by is not None:
        facts["fedinfer.instance"] = ctx.served_by.id
    if ctx.ttft_s is not None:
        facts["fedinfer.ttft_ms"] = ctx.ttft_s * 1000.0
    if ctx.prompt_tokens is not None:
        facts["gen_ai.usage.input_tokens"] = ctx.prompt_tokens
    if ctx.cached_tokens is not None:
        facts["fedinfer.cached_tokens"] = ctx.cached_tokens
    if ctx.used_tokens is not None and ctx.prompt_tokens is not None:
        facts["gen_ai.usage.output_tokens"] = ctx.used_tokens - ctx.prompt_tokens
    return facts


async def _watch_disconnect(
    receive: Receive, ctx: RequestContext, task: asyncio.Task[Any] | None
) -> None:
    """Cancel the request's task when the client goes away, so the upstream is closed too."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            if ctx.complete:
                return
            ctx.disconnected = True
            if task is not None:
                task.cancel()
            return
