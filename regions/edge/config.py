"""The edge's settings, each default written once: ``flags.py`` reads its flags' defaults here."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from regions.edge.control.table_sync import SyncConfig
from regions.edge.metering.meter import MeteringConfig
from regions.edge.policy.prefix_index import BLOCK_BYTES, BYTES_PER_TOKEN
from regions.edge.policy.scheduler import SchedulerConfig
from regions.edge.stages.cold import ColdConfig
from regions.edge.view.health import HealthConfig
from regions.engines.block_hash import DEFAULT_SEED
from regions.engines.prompt_tokens import DEFAULT_MAX_CHARS
from regions.tables.schema import lease_holder


@dataclass(frozen=True, slots=True)
class DisaggConfig:
    """Disaggregated prefill/decode routing (``disagg.py``)."""

    #: With mixed instances as well, shorter prompts go to them: the extra hop and the KV
    #: transfer cost more than a short prefill interferes with decodes.
    min_prompt_tokens: int = 256
    #: KV usage from which a decode instance is passed over while another has room.
    kv_full: float = 0.95
    #: How often a request re-decides while every candidate of a hop is at its cap.
    wait_poll_s: float = 0.02


@dataclass(frozen=True, slots=True)
class TracingConfig:
    """OpenTelemetry spans of each request, exported over OTLP/HTTP (``tracing.py``)."""

    #: Where spans go: an OTLP/HTTP traces URL, e.g. ``http://collector:4318/v1/traces``.
    endpoint: str
    service_name: str = "fedinfer-edge"
    #: Share of new traces recorded; a caller's sampled ``traceparent`` decides for its own.
    sample_ratio: float = 1.0
    #: Spans buffered for export; past it new spans are dropped, never the request slowed.
    max_queue: int = 2048
    export_timeout_s: float = 10.0


@dataclass(frozen=True, slots=True)
class EdgeConfig:
    region: str
    #: File mode (``--table``); None when the table comes from the control plane.
    table_path: Path | None
    #: Its registered name (``--edge-name``): usage records and budget leases go by it.
    name: str | None = None
    #: This process among the edge's worker processes on one port (``--workers``): worker
    #: ``worker`` of ``workers``, each with its own leases and usage records (:attr:`holder`).
    worker: int = 0
    workers: int = 1
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    health: HealthConfig = field(default_factory=HealthConfig)
    disagg: DisaggConfig = field(default_factory=DisaggConfig)
    #: Holding requests for models scaled to zero (``cold.py``).
    cold: ColdConfig = field(default_factory=ColdConfig)
    max_body_bytes: int = 4 * 1024 * 1024
    queue_size: int = 256
    queue_timeout_s: float = 5.0
    max_retries: int = 2
    #: Times a stream whose engine failed after its first byte may be continued on another
    #: instance (``continuation.py``; 0: cut it, as before), and the bytes of relayed events
    #: an edge keeps per stream to do it (a longer answer is cut instead).
    max_continuations: int = 2
    continue_memory_bytes: int = 4 * 1024 * 1024
    #: Streams still running on an instance that left the table (drained) this long are moved
    #: to another instance (None: they run to their end there).
    drain_migrate_after_s: float | None = 1.0
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
    #: Model -> its ``tokenizer.json`` (or the directory holding it and tokenizer_config.json):
    #: prompts of these models are matched exactly against the engines' KV events.
    tokenizers: Mapping[str, Path] = field(default_factory=dict)
    #: Characters of a rendered prompt tokenized at most (the head of a longer one is).
    tokenize_max_chars: int = DEFAULT_MAX_CHARS
    #: The engines' ``PYTHONHASHSEED``, if they run with one (vLLM's default seed otherwise).
    kv_hash_seed: str = DEFAULT_SEED
    session_capacity: int = 100_000
    retry_after_s: int = 1
    #: Control-plane mode (``--control-plane``): table sync and heartbeats.
    sync: SyncConfig | None = None
    #: The region's Redis, where its edges share their live load (``peer_load.py``); None:
    #: this edge sees the others' requests only in the engines' scraped ``/metrics``.
    peer_redis_url: str | None = None
    #: The region's peer-sync keys (``peer_auth.peer_keys``) that sign and verify those
    #: reports: the first signs, every one verifies. Required with ``peer_redis_url``.
    peer_keys: Mapping[str, bytes] = field(default_factory=dict)
    #: Seconds of a tenant's rate a token bucket holds (burst), see admission.py.
    rate_burst_s: float = 2.0
    #: Keys that sign and verify forwarded requests (hop.py): a verified hop is not charged
    #: against the tenant's rate limits again. Empty: hops are unsigned and charged here too.
    hop_keys: Mapping[str, bytes] = field(default_factory=dict)
    #: Spill on latency only when the local queue wait exceeds a remote's RTT by this much.
    spill_margin_s: float = 0.05
    #: Carry out the plan's split (split.py) only while the remote's RTT is within the local
    #: queue wait plus this: the latency a request may trade for the plan's cheaper region.
    split_margin_s: float = 0.1
    #: Learn each instance's prefill rate from its streamed answers (speed.py).
    learn_speeds: bool = True
    #: Usage metering (``metering/meter.py``): None meters nothing.
    metering: MeteringConfig | None = None
    #: OpenTelemetry tracing (``tracing.py``): None (the default) records no span.
    tracing: TracingConfig | None = None
    #: Tenants with a Prometheus label value of their own (by requests); the rest are ``other``.
    tenant_series: int = 20

    @property
    def holder(self) -> str | None:
        """Its name as this worker (``lease_holder``): what its leases and usage go by."""
        return lease_holder(self.name, self.worker) if self.name is not None else None
