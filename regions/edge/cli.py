"""``fedinfer edge``: one region's edge router (its own lean HTTP/1.1 server on uvloop), from
its flags (``flags.py``) to a running edge, or to several worker processes (``workers.py``)."""

from __future__ import annotations

import argparse
import gc
import logging
import os
from collections.abc import Callable
from pathlib import Path

import uvloop

from regions.edge.app import Edge
from regions.edge.config import DisaggConfig, EdgeConfig, TracingConfig
from regions.edge.control.table_sync import SyncConfig, initial_table
from regions.edge.flags import build_parser
from regions.edge.http.server import EdgeServer, ServerLimits
from regions.edge.metering.meter import MeteringConfig
from regions.edge.policy.hop import hop_keys
from regions.edge.policy.peer_auth import peer_keys
from regions.edge.policy.scheduler import SchedulerConfig
from regions.edge.stages.cold import ColdConfig
from regions.edge.view.health import HealthConfig
from regions.edge.workers import WorkerPool, reserve_port, worker_config
from regions.tables.schema import (
    MAX_EDGE_NAME,
    MAX_EDGE_WORKERS,
    TableError,
    check_successor,
    decode_table,
    lease_holder,
)
from regions.tables.signing import parse_key_ring
from regions.tables.usage import usage_stream_key

log = logging.getLogger("fedinfer.edge")


def tracing_from_args(opts: argparse.Namespace) -> TracingConfig | None:
    """Tracing settings; asked for without the tracing extra installed is a clear error."""
    if not opts.otlp_endpoint:
        return None
    if not 0.0 <= opts.trace_sample_ratio <= 1.0:
        raise ValueError("--trace-sample-ratio must be 0..1")
    if opts.trace_max_queue < 1:
        raise ValueError("--trace-max-queue must be at least 1")
    try:
        import regions.edge.tracing  # noqa: F401  (opentelemetry-sdk and its OTLP exporter)
    except ImportError as exc:
        raise ValueError(
            f"--otlp-endpoint needs the tracing extra ({exc}): pip install 'fedinfer[tracing]'"
        ) from exc
    return TracingConfig(
        endpoint=opts.otlp_endpoint,
        service_name=opts.trace_service_name,
        sample_ratio=opts.trace_sample_ratio,
        max_queue=opts.trace_max_queue,
    )


def _cold_config(opts: argparse.Namespace) -> ColdConfig:
    if not 1 <= opts.cold_hold_requests <= 100_000:
        raise ValueError("--cold-hold-requests must be 1..100000")
    if not 0 < opts.cold_hold_max <= 3600:
        raise ValueError("--cold-hold-max must be within (0, 3600] seconds")
    if not 0 <= opts.cold_hold_margin <= 600:
        raise ValueError("--cold-hold-margin must be within [0, 600] seconds")
    return ColdConfig(
        max_held=opts.cold_hold_requests,
        max_hold_s=opts.cold_hold_max,
        margin_s=opts.cold_hold_margin,
    )


def _tenant_series(top: int) -> int:
    if top < 0:
        raise ValueError("--tenant-series must be 0 or more")
    return top


def _metering_from_args(opts: argparse.Namespace, sync: SyncConfig | None) -> MeteringConfig | None:
    if opts.usage_spool_dir is None:
        return None
    if opts.usage_redis_url is None and (sync is None or not sync.edge_name):
        raise ValueError(
            "--usage-spool-dir needs --usage-redis-url, or --control-plane with --edge-name"
        )
    stream_key = None
    if opts.usage_redis_url is not None:
        if not opts.edge_name:
            raise ValueError(_STREAM_IDENTITY)
        stream_key = usage_stream_key(sync.credential if sync else _credential(opts))
    if not 0.001 <= opts.usage_flush_interval <= 60.0:
        raise ValueError("--usage-flush-interval must be between 0.001 and 60 seconds")
    return MeteringConfig(
        spool_dir=opts.usage_spool_dir,
        flush_interval_s=opts.usage_flush_interval,
        max_bytes=opts.usage_spool_max_bytes,
        full_policy=opts.usage_spool_full,
        redis_url=opts.usage_redis_url,
        stream_edge=opts.edge_name if opts.usage_redis_url is not None else None,
        stream_key=stream_key,
    )


#: The usage stream takes only batches signed as a registered edge.
_STREAM_IDENTITY = (
    "--usage-redis-url needs --edge-name and the edge's --credential-file: the worker "
    "ingests only stream entries signed with a registered edge's credential"
)


def _credential(opts: argparse.Namespace) -> str:
    """The edge's credential from ``--credential-file`` (never from argv)."""
    if opts.credential_file is None:
        raise ValueError(_STREAM_IDENTITY)
    try:
        credential = str(opts.credential_file.read_text()).strip()
    except OSError as exc:
        raise ValueError(f"cannot read credential file {opts.credential_file}: {exc}") from exc
    if not credential:
        raise ValueError(f"credential file {opts.credential_file} is empty")
    return credential


def ring_text(path: Path | None, env: str) -> str:
    """A key ring from ``path`` (commas or one entry a line), else from ``$env``: never from
    argv, which any local user sees in the process list."""
    if path is None:
        return os.environ.get(env, "")
    try:
        text = path.read_text()
    except OSError as exc:
        raise ValueError(f"cannot read key ring file {path}: {exc}") from exc
    if not text.strip():
        raise ValueError(f"key ring file {path} is empty")
    return text.replace("\n", ",")


def sync_from_args(opts: argparse.Namespace) -> SyncConfig | None:
    """Control-plane mode settings; a missing or malformed one is a clear error."""
    if opts.control_plane is None:
        # A file-mode edge's credential signs its usage stream entries.
        alone = (
            ("table_keys_file",) if opts.usage_redis_url else ("credential_file", "table_keys_file")
        )
        for flag in alone:
            if getattr(opts, flag) is not None:
                raise ValueError(f"--{flag.replace('_', '-')} needs --control-plane")
        return None
    if opts.credential_file is None:
        raise ValueError("--control-plane needs --credential-file")
    try:
        credential = opts.credential_file.read_text().strip()
    except OSError as exc:
        raise ValueError(f"cannot read credential file {opts.credential_file}: {exc}") from exc
    if not credential:
        raise ValueError(f"credential file {opts.credential_file} is empty")
    keys = parse_key_ring(ring_text(opts.table_keys_file, "FEDINFER_TABLE_KEYS"))
    if not keys:
        raise ValueError("--control-plane needs --table-keys-file (or $FEDINFER_TABLE_KEYS)")
    if not 0 <= opts.sync_wait <= 30:
        raise ValueError("--sync-wait must be 0..30")
    return SyncConfig(
        control_plane=opts.control_plane,
        credential=credential,
        keys=keys,
        state_dir=opts.state_dir or Path("var") / f"edge-{opts.region}",
        edge_name=opts.edge_name,
        wait_s=opts.sync_wait,
        heartbeat_s=opts.heartbeat_interval,
        initial_timeout_s=opts.initial_timeout,
    )


def peer_keys_from_args(opts: argparse.Namespace, sync: SyncConfig | None) -> dict[str, bytes]:
    """The region's peer-sync keys: from ``--peer-keys-file`` / ``$FEDINFER_PEER_KEYS``, else
    the table key ring (control-plane mode). Peer sync without any is refused: its channel is
    open to whoever reaches the Redis."""
    text = ring_text(opts.peer_keys_file, "FEDINFER_PEER_KEYS")
    ring = parse_key_ring(text) if text else (dict(sync.keys) if sync else {})
    if opts.peer_redis_url and not ring:
        raise ValueError(
            "--peer-redis-url needs a key ring to sign the edges' load reports: "
            "--peer-keys-file (or $FEDINFER_PEER_KEYS), or the table key ring of --control-plane"
        )
    return peer_keys(ring, opts.region)


def config_from_args(opts: argparse.Namespace) -> EdgeConfig:
    sync = sync_from_args(opts)
    hop_text = ring_text(opts.hop_keys_file, "FEDINFER_HOP_KEYS")
    ring = parse_key_ring(hop_text) if hop_text else (dict(sync.keys) if sync else {})
    return EdgeConfig(
        region=opts.region,
        table_path=opts.table,
        name=opts.edge_name,
        sync=sync,
        hop_keys=hop_keys(ring),
        peer_keys=peer_keys_from_args(opts, sync),
        scheduler=SchedulerConfig(
            policy=opts.policy,
            affinity_factor=opts.affinity_factor,
            affinity_margin_s=opts.affinity_margin_ms / 1000.0,
            step_tokens=opts.step_tokens,
            decode_slowdown=opts.decode_slowdown,
            balance_abs=opts.balance_abs,
            balance_rel=opts.balance_rel,
            balance_floor=opts.balance_floor,
        ),
        health=HealthConfig(
            eject_after=opts.eject_after,
            readmit_after=opts.readmit_after,
            backoff_base_s=opts.backoff_base,
        ),
        disagg=DisaggConfig(
            min_prompt_tokens=opts.disagg_min_prompt_tokens,
            kv_full=opts.disagg_kv_full,
            wait_poll_s=opts.disagg_wait_poll,
        ),
        max_body_bytes=opts.max_body_bytes,
        queue_size=opts.queue_size,
        queue_timeout_s=opts.queue_timeout,
        cold=_cold_config(opts),
        max_retries=opts.max_retries,
        max_continuations=opts.max_continuations,
        continue_memory_bytes=opts.continue_memory,
        drain_migrate_after_s=opts.drain_migrate_after,
        connect_timeout_s=opts.connect_timeout,
        read_timeout_s=opts.read_timeout,
        upstream_ca_file=str(opts.upstream_ca_file) if opts.upstream_ca_file else None,
        probe_interval_s=opts.probe_interval,
        probe_timeout_s=opts.probe_timeout,
        scrape_interval_s=opts.scrape_interval,
        scrape_timeout_s=opts.scrape_timeout,
        table_poll_s=opts.table_poll,
        bytes_per_token=opts.bytes_per_token,
        prefix_capacity=opts.prefix_capacity,
        tokenizers=_tokenizers(opts.tokenizer),
        tokenize_max_chars=opts.tokenize_max_chars,
        kv_hash_seed=opts.kv_hash_seed,
        rate_burst_s=opts.rate_burst,
        spill_margin_s=opts.spill_margin_ms / 1000.0,
        split_margin_s=opts.split_margin_ms / 1000.0,
        learn_speeds=opts.learn_speeds,
        peer_redis_url=opts.peer_redis_url or None,
        metering=_metering_from_args(opts, sync),
        tracing=tracing_from_args(opts),
        tenant_series=_tenant_series(opts.tenant_series),
    )


def _tokenizers(specs: list[tuple[str, Path]]) -> dict[str, Path]:
    out: dict[str, Path] = {}
    for model, path in specs:
        if model in out:
            raise SystemExit(f"--tokenizer: {model!r} is given twice")
        if not path.exists():
            raise SystemExit(f"--tokenizer {model}={path}: no such file or directory")
        out[model] = path
    return out


def make_edge(cfg: EdgeConfig) -> Edge:
    """Load the initial table (a bad one stops the edge loudly: there is nothing to serve).

    Control-plane mode: the control plane's current table, or the persisted last good one
    when it does not answer (static stability)."""
    if cfg.sync is not None:
        return Edge(cfg, initial_table(cfg.sync, cfg.region))
    assert cfg.table_path is not None
    try:
        data = cfg.table_path.read_bytes()
    except OSError as exc:
        raise TableError(f"cannot read routing table {cfg.table_path}: {exc}") from exc
    table = decode_table(data)
    check_successor(None, table, region=cfg.region)
    edge = Edge(cfg, table)
    edge.mark_loaded(data)
    return edge


_LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s"


def main(argv: list[str]) -> None:
    opts = build_parser().parse_args(argv)
    logging.basicConfig(level=opts.log_level.upper(), format=_LOG_FORMAT)
    # One line per probe and scrape (several a second) would drown the edge's own log.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        cfg = config_from_args(opts)
        check_workers(opts)
    except (TableError, ValueError) as exc:
        raise SystemExit(f"fedinfer edge: {exc}") from exc
    if opts.workers == 1:
        run_worker(opts, cfg, opts.port)
    else:
        raise SystemExit(run_workers(opts, cfg))


def run_worker(
    opts: argparse.Namespace,
    cfg: EdgeConfig,
    port: int,
    worker: int = 0,
    ready: Callable[[], None] | None = None,
) -> None:
    """Run one edge process (the edge, or one of its workers) until a signal stops it."""
    try:
        edge = make_edge(worker_config(cfg, worker, opts.workers))
    except (TableError, ValueError) as exc:
        raise SystemExit(f"fedinfer edge: {exc}") from exc
    server = serve(
        edge,
        opts.host,
        port,
        _operator(opts, worker),
        _limits(opts),
        reuse_port=opts.workers > 1,
        ready=ready,
    )
    uvloop.run(server)


def run_workers(opts: argparse.Namespace, cfg: EdgeConfig) -> int:
    """Run ``--workers`` edge processes on one port (``workers.py``); their exit status."""
    try:
        held = reserve_port(opts.host, opts.port)
    except OSError as exc:
        raise SystemExit(f"fedinfer edge: cannot bind {opts.host}:{opts.port}: {exc}") from exc
    port = int(held.getsockname()[1])

    def start(worker: int, ready: Callable[[], None]) -> None:
        held.close()
        worker_format = _LOG_FORMAT.replace(" %(message)s", f"[{worker}] %(message)s")
        logging.basicConfig(level=opts.log_level.upper(), format=worker_format, force=True)
        run_worker(opts, cfg, port, worker, ready)

    log.info("edge of region %s: %d workers on %s:%d", opts.region, opts.workers, opts.host, port)
    with held:
        return WorkerPool(opts.workers, start).run()


def check_workers(opts: argparse.Namespace) -> None:
    """``--workers`` and what several need: a peer Redis, room for the workers' names and
    operator ports."""
    workers = opts.workers
    if not 1 <= workers <= MAX_EDGE_WORKERS:
        raise ValueError(f"--workers must be 1..{MAX_EDGE_WORKERS}")
    if workers == 1:
        return
    if not opts.peer_redis_url:
        raise ValueError(
            "--workers above 1 needs --peer-redis-url: workers that do not share their load, "
            "prefix cache and sessions route worse together than one alone"
        )
    name = opts.edge_name
    if name is not None and len(lease_holder(name, workers - 1)) > MAX_EDGE_NAME:
        raise ValueError(
            f"--edge-name {name!r} is too long for {workers} workers: its last worker's name "
            f"{lease_holder(name, workers - 1)!r} must fit in {MAX_EDGE_NAME} characters"
        )
    if opts.operator_port and opts.operator_port + workers - 1 > 65535:
        raise ValueError(f"--operator-port leaves no room for {workers} workers' ports")


def _operator(opts: argparse.Namespace, worker: int) -> tuple[str, int] | None:
    """Worker ``worker``'s operator listener: ``--operator-port`` plus its index."""
    if opts.operator_port is None:
        return None
    return (opts.operator_host, opts.operator_port + worker if opts.operator_port else 0)


def _limits(opts: argparse.Namespace) -> ServerLimits:
    return ServerLimits(
        max_connections=opts.max_connections,
        max_head_bytes=opts.max_head_bytes,
        head_timeout_s=opts.head_timeout,
        body_timeout_s=opts.body_timeout,
        write_timeout_s=opts.write_timeout,
        keep_alive_s=opts.keep_alive,
    )


async def serve(
    edge: Edge,
    host: str,
    port: int,
    operator: tuple[str, int] | None = None,
    limits: ServerLimits | None = None,
    *,
    reuse_port: bool = False,
    ready: Callable[[], None] | None = None,
) -> None:
    """Start the edge's background work, serve until SIGINT/SIGTERM, then drain and stop.

    ``operator``: (host, port) of the operator listener, a server of its own so that a flood
    on the public port never holds back a health check or a scrape. ``reuse_port``: one of the
    edge's workers (``workers.py``), ``ready`` called once it serves."""
    server = EdgeServer(edge, limits)
    edge.metrics.http_refusals = server.refusals
    edge.metrics.open_connections = lambda: len(server.connections)
    ops = EdgeServer(edge.operator) if operator is not None else None
    await edge.startup()
    # What exists now (modules, table, metric families) lives as long as the process: keep it
    # out of the collector's way, and collect the young generation less often — each request
    # allocates a few hundred short-lived objects, and full collections over a large prefix
    # index would otherwise show up as latency spikes.
    gc.freeze()
    gc.set_threshold(50_000, 20, 100)
    try:
        if ops is not None and operator is not None:
            ops_port = await ops.start(*operator)
            log.info("operator endpoints on http://%s:%d", operator[0], ops_port)
        bound = await server.start(host, port, reuse_port=reuse_port)
        log.info("edge of region %s serving on http://%s:%d", edge.cfg.region, host, bound)
        server.handle_signals()
        if ready is not None:
            ready()
        await server.wait_stopped()
        log.info("edge of region %s stopping", edge.cfg.region)
    finally:
        await server.shutdown()
        if ops is not None:
            await ops.shutdown()
        await edge.shutdown()
        log.info("edge of region %s stopped", edge.cfg.region)
