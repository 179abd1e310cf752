"""``fedinfer edge``: one region's edge router (its own lean HTTP/1.1 server on uvloop)."""

from __future__ import annotations

import argparse
import gc
import logging
import os
from collections.abc import Callable
from pathlib import Path

import uvloop

from regions.edge.app import Edge
from regions.edge.cold import ColdConfig
from regions.edge.config import DisaggConfig, EdgeConfig, TracingConfig
from regions.edge.health import HealthConfig
from regions.edge.hop import hop_keys
from regions.edge.metering import MeteringConfig
from regions.edge.scheduler import POLICIES, SchedulerConfig
from regions.edge.server import EdgeServer, ServerLimits
from regions.edge.sync import SyncConfig, initial_table
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

log = logging.getLogger("fedinfer.edge")


# Each flag's default is its setting's, written once (config.py and the configs it holds).
_LIMITS = ServerLimits()
_EDGE = EdgeConfig(region="", table_path=None)
_SCHEDULER = _EDGE.scheduler
_HEALTH = _EDGE.health
_DISAGG = _EDGE.disagg
_SYNC = SyncConfig(control_plane="", credential="", keys={}, state_dir=Path())
_METERING = MeteringConfig(spool_dir=Path())
_TRACING = TracingConfig(endpoint="")


#: (flag, type, default, help) of the flags that only set a value.
_Flag = tuple[str, type, object, str | None]


def _add(p: argparse.ArgumentParser, flags: tuple[_Flag, ...]) -> None:
    for flag, kind, default, text in flags:
        p.add_argument(flag, type=kind, default=default, help=text)


def build_parser() -> argparse.ArgumentParser:
    # No abbreviations: an old ``--table-keys SECRET`` must not be taken for ``--table-keys-file``
    # (and its secret printed in the error).
    p = argparse.ArgumentParser(prog="fedinfer edge", description=__doc__, allow_abbrev=False)
    p.add_argument("--region", required=True, help="region code this edge serves")
    _table_source_flags(p)
    _server_flags(p)
    _routing_flags(p)
    _engine_flags(p)
    _prefix_flags(p)
    _metering_flags(p)
    _observability_flags(p)
    p.add_argument("--log-level", default="info")
    return p


def _table_source_flags(p: argparse.ArgumentParser) -> None:
    """Where the routing table comes from: a file, or the control plane (signed, synced)."""
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--table", type=Path, help="routing-table JSON document (file mode)")
    source.add_argument(
        "--control-plane", help="control plane base URL: fetch signed tables from it"
    )
    p.add_argument("--credential-file", type=Path, help="file holding this edge's credential")
    p.add_argument(
        "--table-keys-file",
        type=Path,
        help="file holding the table verification key ring 'k1=key,k0=old' (commas or one "
        "entry a line; default: $FEDINFER_TABLE_KEYS)",
    )
    p.add_argument(
        "--hop-keys-file",
        type=Path,
        help="file holding the key ring that signs and verifies requests forwarded between "
        "edges, so a spilled request is rate-charged once (default: $FEDINFER_HOP_KEYS, else "
        "the table key ring in control-plane mode)",
    )
    p.add_argument("--state-dir", type=Path, help="persisted table (default var/edge-<region>)")
    p.add_argument(
        "--edge-name",
        help="this edge's registered name: its heartbeats, usage records and budget leases",
    )
    _add(p, (
        ("--heartbeat-interval", float, _SYNC.heartbeat_s, None),
        ("--sync-wait", int, _SYNC.wait_s, "long-poll seconds (0-30)"),
        ("--initial-timeout", float, _SYNC.initial_timeout_s, "first start without a saved "
         "table"),
        ("--table-poll", float, _EDGE.table_poll_s, "seconds between file checks"),
    ))  # fmt: skip


def _server_flags(p: argparse.ArgumentParser) -> None:
    """The public listener and its limits, and the operator listener."""
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument(
        "--workers",
        type=int,
        default=1,
        help="edge processes serving the port, the kernel spreading connections over them "
        "(SO_REUSEPORT): each a whole edge with its operator listener on --operator-port plus "
        f"its index, sharing one view over --peer-redis-url (needed; 1-{MAX_EDGE_WORKERS}, "
        "docs/edge-workers.md)",
    )
    _add(p, (
        ("--max-connections", int, _LIMITS.max_connections, "open client connections; past it "
         "a new one gets 503 and is closed"),
        ("--max-head-bytes", int, _LIMITS.max_head_bytes, "request line + headers"),
        ("--head-timeout", float, _LIMITS.head_timeout_s, "seconds for a request head"),
        ("--body-timeout", float, _LIMITS.body_timeout_s, "seconds a request body may stall"),
        ("--write-timeout", float, _LIMITS.write_timeout_s, "seconds a client may leave its "
         "receive buffer full before it is dropped"),
        ("--keep-alive", float, _LIMITS.keep_alive_s, "idle keep-alive seconds"),
        ("--max-body-bytes", int, _EDGE.max_body_bytes, None),
    ))  # fmt: skip
    p.add_argument(
        "--operator-host",
        default="127.0.0.1",
        help="address of the operator listener (/healthz, /metrics); keep it off the internet",
    )
    p.add_argument(
        "--operator-port",
        type=int,
        help="port of the operator listener (/healthz with every instance's state, /metrics); "
        "without it neither is served (never on the public port)",
    )


def _routing_flags(p: argparse.ArgumentParser) -> None:
    """The scheduler, the gateway queue, retries, spill-over and P/D."""
    p.add_argument("--policy", choices=POLICIES, default=_SCHEDULER.policy)
    p.add_argument(
        "--peer-redis-url",
        default=os.environ.get("FEDINFER_PEER_REDIS_URL"),
        help="share live load with the region's other edges over this Redis's pub/sub "
        "(default: $FEDINFER_PEER_REDIS_URL; without one, the others' requests are seen only in "
        "the engines' scraped /metrics)",
    )
    p.add_argument(
        "--learn-speeds",
        action=argparse.BooleanOptionalAction,
        default=_EDGE.learn_speeds,
        help="learn each instance's prefill rate from its streamed answers, starting from the "
        "table's figure (--no-learn-speeds: trust the table)",
    )
    _add(p, (
        ("--queue-size", int, _EDGE.queue_size, "requests waiting for capacity"),
        ("--queue-timeout", float, _EDGE.queue_timeout_s, "seconds a request may wait"),
        ("--max-retries", int, _EDGE.max_retries, "other instances tried before byte one"),
        ("--cold-hold-requests", int, _EDGE.cold.max_held, "requests held per model scaled "
         "to zero while a replica starts; more get 503 model_cold"),
        ("--cold-hold-max", float, _EDGE.cold.max_hold_s, "seconds a request for a model "
         "scaled to zero is held at most (else its expected cold start)"),
        ("--cold-hold-margin", float, _EDGE.cold.margin_s, "seconds added to a model's "
         "measured cold start for the wake-up's round trip (heartbeat, autoscale, table)"),
        ("--affinity-factor", float, _SCHEDULER.affinity_factor, None),
        ("--affinity-margin-ms", float, _SCHEDULER.affinity_margin_s * 1000.0, None),
        ("--step-tokens", float, _SCHEDULER.step_tokens, "one engine step costs about as much "
         "as prefilling this many tokens"),
        ("--decode-slowdown", float, _SCHEDULER.decode_slowdown, "a full batch of decodes "
         "makes a step (1 + this) times as long as a lone one"),
        ("--balance-abs", float, _SCHEDULER.balance_abs, "a new session skips instances "
         "busier (per slot) than the least loaded one by more than this, and more than "
         "--balance-rel times and above --balance-floor (docs/edge-scheduling.md)"),
        ("--balance-rel", float, _SCHEDULER.balance_rel, "see --balance-abs"),
        ("--balance-floor", float, _SCHEDULER.balance_floor, "see --balance-abs"),
        ("--bytes-per-token", float, _EDGE.bytes_per_token, None),
        ("--prefix-capacity", int, _EDGE.prefix_capacity, "block hashes kept"),
        ("--rate-burst", float, _EDGE.rate_burst_s, "seconds of a tenant's rate limit as burst"),
        ("--spill-margin-ms", float, _EDGE.spill_margin_s * 1000.0, "spill to a remote only "
         "when the local queue wait exceeds its RTT by this much"),
        ("--split-margin-ms", float, _EDGE.split_margin_s * 1000.0, "send the plan's share of "
         "new sessions to a remote only while its RTT is within the local queue wait plus "
         "this"),
        ("--disagg-min-prompt-tokens", int, _DISAGG.min_prompt_tokens, "P/D: with mixed "
         "instances as well, shorter prompts go to them"),
        ("--disagg-kv-full", float, _DISAGG.kv_full, "P/D: KV usage from which a decode "
         "instance is passed over while another has room"),
        ("--disagg-wait-poll", float, _DISAGG.wait_poll_s, "P/D: seconds between decisions "
         "while every decode instance is at its cap"),
    ))  # fmt: skip


def _tokenizer_spec(text: str) -> tuple[str, Path]:
    model, sep, path = text.partition("=")
    if not sep or not model or not path:
        raise argparse.ArgumentTypeError(f"expected MODEL=PATH, got {text!r}")
    return model, Path(path)


def _prefix_flags(p: argparse.ArgumentParser) -> None:
    """Exact prefix-cache knowledge: the models' tokenizers and the engines' hash seed."""
    p.add_argument(
        "--tokenizer",
        type=_tokenizer_spec,
        action="append",
        default=[],
        metavar="MODEL=PATH",
        help="the model's tokenizer.json, or the directory holding it and "
        "tokenizer_config.json (the chat template): its prompts are matched exactly against "
        "the engines' KV events (repeat per model; others use the byte estimate)",
    )
    _add(p, (
        ("--tokenize-max-chars", int, _EDGE.tokenize_max_chars, "characters of a rendered "
         "prompt tokenized at most (only the head of a longer prompt is matched)"),
        ("--kv-hash-seed", str, _EDGE.kv_hash_seed, "the engines' PYTHONHASHSEED, if they run "
         "with one (the first block's parent hash; default: vLLM's own seed)"),
    ))  # fmt: skip


def _metering_flags(p: argparse.ArgumentParser) -> None:
    """Usage metering: a record per served request, spooled here and shipped (metering.py)."""
    p.add_argument(
        "--usage-spool-dir",
        type=Path,
        help="meter usage: spool each request's usage record here until the control plane has "
        "it (without this flag nothing is metered)",
    )
    p.add_argument(
        "--usage-redis-url",
        default=os.environ.get("FEDINFER_USAGE_REDIS_URL"),
        help="ship usage to this Redis's usage stream (default: $FEDINFER_USAGE_REDIS_URL; "
        "without one, to the control plane's usage endpoint)",
    )
    p.add_argument(
        "--usage-spool-full",
        choices=("refuse", "serve"),
        default=_METERING.full_policy,
        help="when the spool is full: refuse new requests (503) or serve them unmetered",
    )
    _add(p, (
        ("--usage-spool-max-bytes", int, _METERING.max_bytes, "records not yet shipped, bytes"),
        ("--usage-flush-interval", float, _METERING.flush_interval_s, "seconds between spool "
         "writes (one fsync and one shipment each): what a crash can lose, against the cost of a "
         "write per batch"),
    ))  # fmt: skip


def _observability_flags(p: argparse.ArgumentParser) -> None:
    """OpenTelemetry spans (off unless ``--otlp-endpoint``) and the per-tenant series' bound."""
    p.add_argument(
        "--otlp-endpoint",
        default=os.environ.get("FEDINFER_OTLP_ENDPOINT"),
        help="export a trace of every request to this OTLP/HTTP traces URL, e.g. "
        "http://collector:4318/v1/traces (default: $FEDINFER_OTLP_ENDPOINT; without one, "
        "tracing is off). Needs the tracing extra: pip install 'fedinfer[tracing]'",
    )
    _add(p, (
        ("--trace-sample-ratio", float, _TRACING.sample_ratio, "share of new traces recorded "
         "(a caller's traceparent decides for its own)"),
        ("--trace-service-name", str, _TRACING.service_name, "the spans' service.name"),
        ("--trace-max-queue", int, _TRACING.max_queue, "spans buffered for export; past it "
         "new spans are dropped"),
        ("--tenant-series", int, _EDGE.tenant_series, "tenants (by requests) with Prometheus "
         "series of their own; the others are counted as tenant=\"other\""),
    ))  # fmt: skip


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
    if not 0.001 <= opts.usage_flush_interval <= 60.0:
        raise ValueError("--usage-flush-interval must be between 0.001 and 60 seconds")
    return MeteringConfig(
        spool_dir=opts.usage_spool_dir,
        flush_interval_s=opts.usage_flush_interval,
        max_bytes=opts.usage_spool_max_bytes,
        full_policy=opts.usage_spool_full,
        redis_url=opts.usage_redis_url,
    )


def _engine_flags(p: argparse.ArgumentParser) -> None:
    """Connections to engines and remote edges, health probes and load scrapes."""
    p.add_argument(
        "--upstream-ca-file",
        type=Path,
        help="PEM bundle that verifies https:// engines and remote edges (default: system CAs)",
    )
    _add(p, (
        ("--connect-timeout", float, _EDGE.connect_timeout_s, None),
        ("--read-timeout", float, _EDGE.read_timeout_s, None),
        ("--probe-interval", float, _EDGE.probe_interval_s, None),
        ("--probe-timeout", float, _EDGE.probe_timeout_s, "seconds an engine's /health may "
         "take before the probe counts as failed"),
        ("--scrape-interval", float, _EDGE.scrape_interval_s, None),
        ("--scrape-timeout", float, _EDGE.scrape_timeout_s, "seconds to wait for an engine's "
         "/metrics (a busy engine answers late)"),
        ("--eject-after", int, _HEALTH.eject_after, "consecutive failures to eject"),
        ("--readmit-after", int, _HEALTH.readmit_after, "consecutive successes to readmit"),
        ("--backoff-base", float, _HEALTH.backoff_base_s, "first ejection, seconds"),
    ))  # fmt: skip


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
        for flag in ("credential_file", "table_keys_file"):
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
