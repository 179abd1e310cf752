"""The flags of ``fedinfer edge``, each default its setting's (``config.py``): what the
command line says, before ``cli.py`` turns it into an edge."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from pathlib import Path

from regions.edge.config import EdgeConfig, TracingConfig
from regions.edge.control.table_sync import SyncConfig
from regions.edge.http.server import ServerLimits
from regions.edge.metering.meter import MeteringConfig
from regions.edge.policy.scheduler import POLICIES
from regions.tables.schema import MAX_EDGE_WORKERS

DESCRIPTION = "One region's edge router (its own lean HTTP/1.1 server on uvloop)."

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
_Flag = tuple[str, Callable[[str], object], object, str | None]


def _seconds_or_never(text: str) -> float | None:
    if text == "never":
        return None
    value = float(text)
    if value < 0:
        raise argparse.ArgumentTypeError("seconds must be at least 0 (or 'never')")
    return value


def _add(p: argparse.ArgumentParser, flags: tuple[_Flag, ...]) -> None:
    for flag, kind, default, text in flags:
        p.add_argument(flag, type=kind, default=default, help=text)


def build_parser() -> argparse.ArgumentParser:
    # No abbreviations: an old ``--table-keys SECRET`` must not be taken for ``--table-keys-file``
    # (and its secret printed in the error).
    p = argparse.ArgumentParser(prog="fedinfer edge", description=DESCRIPTION, allow_abbrev=False)
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
    p.add_argument(
        "--peer-keys-file",
        type=Path,
        help="file holding the key ring that signs and verifies the load reports the region's "
        "edges share over --peer-redis-url (default: $FEDINFER_PEER_KEYS, else the table key "
        "ring in control-plane mode; peer sync needs one)",
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
        ("--max-continuations", int, _EDGE.max_continuations, "times a stream whose engine "
         "failed after its first byte is continued on another instance (0: cut it)"),
        ("--continue-memory", int, _EDGE.continue_memory_bytes, "bytes of relayed events "
         "kept per stream to continue it; a longer answer is cut instead"),
        ("--drain-migrate-after", _seconds_or_never, _EDGE.drain_migrate_after_s, "seconds "
         "after which a stream still running on an instance that left the table (drained) is "
         "continued on another; 'never': it runs to its end there"),
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
