"""The engine's ``/metrics``: vLLM v1's names, labels and buckets (``vllm/v1/metrics/
loggers.py`` and ``buckets.py`` of vLLM 0.32), one ``CollectorRegistry`` per engine.

Gauges and token counters are brought up to date when scraped (from the scheduler's
monotonic totals), not on every step: the exposition is identical and the engine loop stays
cheap. Per-request histograms are observed when their event happens, as vLLM does.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Callable, Iterator, Mapping, Sequence
from itertools import accumulate

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

from regions.engines.simulator.scheduler import SchedulerCounters

#: A bucket bound as Prometheus labels it (``1e+06``, ``+Inf``), exactly as prometheus_client's
#: own histograms do; the library leaves this helper unannotated, so it is typed here.
_go_float: Callable[[float], str] = floatToGoString

FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")
REQUEST_LATENCY_BUCKETS: tuple[float, ...] = (
    *(0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0),
    *(120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0),
)
TTFT_BUCKETS: tuple[float, ...] = (
    *(0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5),
    *(10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0),
)
ITL_BUCKETS: tuple[float, ...] = (
    *(0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5),
    *(10.0, 20.0, 40.0, 80.0),
)
ITERATION_TOKENS_BUCKETS: tuple[float, ...] = (
    *(1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384),
)


def build_1_2_5_buckets(max_value: int) -> list[float]:
    buckets: list[float] = []
    exponent = 0
    while True:
        for m in (1, 2, 5):
            value = m * 10**exponent
            if value > max_value:
                return buckets
            buckets.append(value)
        exponent += 1


class FastHistogram:
    """A histogram for the engine loop's per-token observations: a bisect and two additions,
    no lock (one event loop owns it). Exposed exactly like a prometheus_client histogram."""

    def __init__(
        self,
        name: str,
        documentation: str,
        labels: Sequence[str],
        values: Sequence[str],
        buckets: Sequence[float],
        registry: CollectorRegistry,
    ):
        self.name = name
        self.documentation = documentation
        self.labels = list(labels)
        self.values = list(values)
        self.upper = [float(b) for b in buckets]
        self.counts = [0] * (len(self.upper) + 1)
        self.sum = 0.0
        registry.register(self)

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.upper, value)] += 1
        self.sum += value

    def collect(self) -> Iterator[Metric]:
        family = HistogramMetricFamily(self.name, self.documentation, labels=self.labels)
        cumulative = list(accumulate(self.counts))
        bounds = [_go_float(b) for b in self.upper] + ["+Inf"]
        family.add_metric(self.values, list(zip(bounds, cumulative, strict=True)), self.sum)
        yield family


class _Declarer:
    """Declares metrics in one registry, each labelled with the engine's model name and index;
    hands back the engine's series."""

    __slots__ = ("labels", "registry", "values")

    def __init__(self, registry: CollectorRegistry, model_name: str, engine: str):
        self.registry = registry
        self.labels = ["model_name", "engine"]
        self.values = (model_name, engine)

    def gauge(self, name: str, doc: str) -> Gauge:
        return Gauge(name, doc, self.labels, registry=self.registry).labels(*self.values)

    def counter(self, name: str, doc: str) -> Counter:
        return Counter(name, doc, self.labels, registry=self.registry).labels(*self.values)

    def histogram(self, name: str, doc: str, buckets: Sequence[float]) -> Histogram:
        metric = Histogram(name, doc, self.labels, buckets=buckets, registry=self.registry)
        return metric.labels(*self.values)

    def fast_histogram(self, name: str, doc: str, buckets: Sequence[float]) -> FastHistogram:
        return FastHistogram(name, doc, self.labels, self.values, buckets, self.registry)


class EngineMetrics:
    """One engine's vLLM metrics, registered in vLLM's order (the exposition follows it)."""

    def __init__(
        self,
        model_name: str,
        max_model_len: int,
        cache_info: Mapping[str, str],
        max_loras: int,
        engine: str = "0",
    ):
        self.registry = CollectorRegistry()
        declare = _Declarer(self.registry, model_name, engine)
        self._declare_engine_state(declare)
        self._declare_request_stats(declare, max_model_len)
        self._declare_latencies(declare)
        self._declare_config_info(cache_info, max_loras, engine)
        self._exported = SchedulerCounters()

    def _declare_engine_state(self, declare: _Declarer) -> None:
        """Queue gauges and token counters, brought up to date when scraped (``refresh``)."""
        self.running = declare.gauge(
            "vllm:num_requests_running", "Number of requests in model execution batches."
        )
        self.waiting = declare.gauge(
            "vllm:num_requests_waiting", "Number of requests waiting to be processed."
        )
        self.kv_usage = declare.gauge(
            "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage."
        )
        self.prefix_queries = declare.counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
        )
        self.prefix_hits = declare.counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."
        )
        self.external_queries = declare.counter(
            "vllm:external_prefix_cache_queries",
            "External prefix cache queries from KV connector cross-instance cache sharing, in "
            "terms of number of queried tokens.",
        )
        self.external_hits = declare.counter(
            "vllm:external_prefix_cache_hits",
            "External prefix cache hits from KV connector cross-instance cache sharing, in "
            "terms of number of cached tokens.",
        )
        self.failed_transfers = declare.counter(
            "vllm:nixl_num_failed_transfers", "Number of failed NIXL KV Cache transfers."
        )
        self.preemptions = declare.counter(
            "vllm:num_preemptions", "Cumulative number of preemption from the engine."
        )
        self.prompt_tokens = declare.counter(
            "vllm:prompt_tokens", "Number of prefill tokens processed."
        )
        self.generation_tokens = declare.counter(
            "vllm:generation_tokens", "Number of generation tokens processed."
        )

    def _declare_request_stats(self, declare: _Declarer, max_model_len: int) -> None:
        """Finished requests by reason, and the token counts of requests and steps."""
        success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            [*declare.labels, "finished_reason"],
            registry=declare.registry,
        )
        self.success = {
            reason: success.labels(*declare.values, reason) for reason in FINISH_REASONS
        }
        token_buckets = build_1_2_5_buckets(max_model_len)
        self.request_prompt_tokens = declare.histogram(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed.", token_buckets
        )
        self.request_generation_tokens = declare.histogram(
            "vllm:request_generation_tokens",
            "Number of generation tokens processed.",
            token_buckets,
        )
        self.iteration_tokens = declare.histogram(
            "vllm:iteration_tokens_total",
            "Histogram of number of tokens per engine_step.",
            ITERATION_TOKENS_BUCKETS,
        )
        self.max_tokens_param = declare.histogram(
            "vllm:request_params_max_tokens",
            "Histogram of the max_tokens request parameter.",
            token_buckets,
        )

    def _declare_latencies(self, declare: _Declarer) -> None:
        """Per-token latencies (observed in the engine loop) and per-request phase times."""
        self.ttft = declare.fast_histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            TTFT_BUCKETS,
        )
        self.itl = declare.fast_histogram(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            ITL_BUCKETS,
        )
        self.e2e = declare.histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.queue_time = declare.histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.prefill_time = declare.histogram(
            "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.decode_time = declare.histogram(
            "vllm:request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )

    def _declare_config_info(
        self, cache_info: Mapping[str, str], max_loras: int, engine: str
    ) -> None:
        """The cache configuration, and the LoRA adapters' gauge when LoRA is enabled."""
        Gauge(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            [*cache_info, "engine"],
            registry=self.registry,
        ).labels(*cache_info.values(), engine).set(1)
        self.max_loras = max_loras
        self.lora_info: Gauge | None = None
        if max_loras > 0:
            self.lora_info = Gauge(
                "vllm:lora_requests_info",
                "Running stats on lora requests.",
                ["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
                registry=self.registry,
            )

    def record_finished(
        self,
        reason: str,
        *,
        arrival: float,
        first_scheduled: float | None,
        first_token: float | None,
        finished: float,
        prompt_tokens: int,
        generation_tokens: int,
        max_tokens: int,
    ) -> None:
        self.success[reason].inc()
        self.e2e.observe(finished - arrival)
        if first_scheduled is not None:
            self.queue_time.observe(first_scheduled - arrival)
            if first_token is not None:
                self.prefill_time.observe(first_token - first_scheduled)
                self.decode_time.observe(finished - first_token)
        self.request_prompt_tokens.observe(prompt_tokens)
        self.request_generation_tokens.observe(generation_tokens)
        self.max_tokens_param.observe(max_tokens)

    def refresh(
        self,
        counters: SchedulerCounters,
        *,
        running: int,
        waiting: int,
        kv_usage: float,
        running_loras: set[str],
        waiting_loras: set[str],
    ) -> None:
        """Bring gauges and counters to the engine's present state."""
        self.running.set(running)
        self.waiting.set(waiting)
        self.kv_usage.set(kv_usage)
        done = self._exported
        for name, metric in (
            ("prefix_cache_queries", self.prefix_queries),
            ("prefix_cache_hits", self.prefix_hits),
            ("external_prefix_cache_queries", self.external_queries),
            ("external_prefix_cache_hits", self.external_hits),
            ("kv_transfer_failures", self.failed_transfers),
            ("preemptions", self.preemptions),
            ("prompt_tokens", self.prompt_tokens),
            ("generation_tokens", self.generation_tokens),
        ):
            delta = getattr(counters, name) - getattr(done, name)
            if delta > 0:
                metric.inc(delta)
                setattr(done, name, getattr(counters, name))
        if self.lora_info is not None:
            self.lora_info.labels(
                str(self.max_loras),
                ",".join(sorted(waiting_loras)),
                ",".join(sorted(running_loras)),
            ).set(time.time())

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
