"""Parse a vLLM ``/metrics`` exposition into the few load numbers the edge routes on.

The edge scrapes every engine every <= 500 ms, so this is a hand-rolled scan and not
``prometheus_client.parser``: each wanted metric name is located with ``str.find`` (C speed)
and only its own lines are decoded, which skips the hundreds of histogram bucket lines a real
vLLM exposition carries (see ``bench`` numbers in ``docs/engine-simulator.md``).

Accepted names: vLLM v1 (``vllm:kv_cache_usage_perc``, ``vllm:prefix_cache_queries_total``,
...) and the older names still emitted by vLLM 0.7-0.10 (``vllm:gpu_cache_usage_perc``,
``vllm:gpu_prefix_cache_queries_total``, ...). When both are present the v1 name wins, so a
server that emits both is not counted twice. Series that differ only in the ``engine`` or
``model_name`` label (data parallel engines behind one API server) are summed; the KV-cache
usage fraction is averaged, since each engine has a cache of its own.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

__all__ = ["EngineLoad", "parse_labels", "parse_vllm_metrics"]


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """Live load of one vLLM server (all its engines), as scraped from ``/metrics``."""

    num_requests_running: int = 0
    num_requests_waiting: int = 0
    #: Fraction of KV-cache blocks in use, 0..1 (vLLM's ``*_perc`` gauges are fractions).
    kv_cache_usage_perc: float = 0.0
    #: Prefix-cache lookups and hits, in tokens (vLLM counts tokens, not blocks).
    prefix_cache_queries_total: int = 0
    prefix_cache_hits_total: int = 0
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    #: Finished requests of every ``finished_reason`` (stop, length, abort, ...).
    request_success_total: int = 0
    num_preemptions_total: int = 0
    #: Adapters in the newest ``vllm:lora_requests_info`` series; empty without LoRA.
    running_lora_adapters: tuple[str, ...] = ()
    waiting_lora_adapters: tuple[str, ...] = ()
    max_lora: int | None = None
    #: From ``vllm:cache_config_info`` when the server publishes it.
    block_size: int | None = None
    num_gpu_blocks: int | None = None
    #: Distinct ``model_name`` label values (the served model names).
    model_names: tuple[str, ...] = ()
    #: The inter-token latency histogram's sum (seconds) and count (gaps) since the server
    #: started: between two readings, the engine's own mean decode step.
    inter_token_latency_seconds_sum: float = 0.0
    inter_token_latency_seconds_count: int = 0

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Token hit rate since the server started (0 when nothing was queried)."""
        q = self.prefix_cache_queries_total
        return self.prefix_cache_hits_total / q if q else 0.0


# (field, preferred names first). Counters appear with ``_total`` in the text format; the bare
# name is accepted too for hand-written or OpenMetrics-converted expositions.
_SUMMED: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("num_requests_running", ("vllm:num_requests_running",)),
    ("num_requests_waiting", ("vllm:num_requests_waiting",)),
    (
        "prefix_cache_queries_total",
        (
            "vllm:prefix_cache_queries_total",
            "vllm:prefix_cache_queries",
            "vllm:gpu_prefix_cache_queries_total",
            "vllm:gpu_prefix_cache_queries",
        ),
    ),
    (
        "prefix_cache_hits_total",
        (
            "vllm:prefix_cache_hits_total",
            "vllm:prefix_cache_hits",
            "vllm:gpu_prefix_cache_hits_total",
            "vllm:gpu_prefix_cache_hits",
        ),
    ),
    ("prompt_tokens_total", ("vllm:prompt_tokens_total", "vllm:prompt_tokens")),
    ("generation_tokens_total", ("vllm:generation_tokens_total", "vllm:generation_tokens")),
    ("request_success_total", ("vllm:request_success_total", "vllm:request_success")),
    ("num_preemptions_total", ("vllm:num_preemptions_total", "vllm:num_preemptions")),
)
#: vLLM >= 0.11's name first, then the older one of the same histogram.
_ITL_NAMES = ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds")
_KV_USAGE_NAMES = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
_LORA_INFO = "vllm:lora_requests_info"
_CACHE_INFO = "vllm:cache_config_info"
_MODEL_LABEL_SOURCE = "vllm:num_requests_running"

_LABEL_RE = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"')


def _unescape(value: str) -> str:
    if "\\" not in value:
        return value
    return value.replace("\\\\", "\0").replace('\\"', '"').replace("\\n", "\n").replace("\0", "\\")


def parse_labels(labels: str) -> dict[str, str]:
    """Decode the inside of ``{...}`` (exposition-format escaping) into a dict."""
    return {k: _unescape(v) for k, v in _LABEL_RE.findall(labels)}


def _series(text: str, name: str) -> list[tuple[str, float]]:
    """All samples of exactly ``name``: ``(label text, value)``; labels without braces.

    ``text`` must start with a newline (the caller prepends one) so that every sample line,
    including the first, is found as ``"\\n" + name`` followed by ``{`` or a space.
    """
    needle = "\n" + name
    n = len(needle)
    out: list[tuple[str, float]] = []
    find = text.find
    pos = find(needle)
    while pos >= 0:
        start = pos + n
        nxt = text[start : start + 1]
        if nxt == "{" or nxt == " ":
            eol = find("\n", start)
            line = text[start:] if eol < 0 else text[start:eol]
            if nxt == "{":
                close = line.rfind("}")
                if close < 0:
                    raise ValueError(f"unterminated labels in metric line {name}{line!r}")
                labels, rest = line[1:close], line[close + 1 :]
            else:
                labels, rest = "", line
            parts = rest.split()
            if not parts:
                raise ValueError(f"metric line without a value: {name}{line!r}")
            out.append((labels, float(parts[0])))
            pos = find(needle, start if eol < 0 else eol)
        else:
            pos = find(needle, start)
    return out


def _finite(v: float) -> float:
    return v if math.isfinite(v) else 0.0


def parse_vllm_metrics(text: str) -> EngineLoad:
    """Extract :class:`EngineLoad` from a vLLM Prometheus text exposition.

    Metrics that are absent default to zero (or ``None``/empty for info metrics), so a server
    of an older vLLM without, say, prefix-cache counters still yields its queue lengths.
    Raises ``ValueError`` on a malformed line of a metric it reads.
    """
    text = "\n" + text
    totals, running_samples = _summed(text)
    kv_usage = _kv_usage(text)
    running, waiting, max_lora = _lora_adapters(text)
    block_size, num_gpu_blocks = _cache_config(text)
    itl_sum, itl_count = _inter_token_latency(text)
    return EngineLoad(
        inter_token_latency_seconds_sum=itl_sum,
        inter_token_latency_seconds_count=itl_count,
        kv_cache_usage_perc=kv_usage,
        running_lora_adapters=running,
        waiting_lora_adapters=waiting,
        max_lora=max_lora,
        block_size=block_size,
        num_gpu_blocks=num_gpu_blocks,
        model_names=_model_names(running_samples),
        **totals,
    )


def _summed(text: str) -> tuple[dict[str, int], list[tuple[str, float]]]:
    """The summed ``EngineLoad`` fields found (the first name present of each), and the
    running-requests samples, whose labels name the served models."""
    totals: dict[str, int] = {}
    running_samples: list[tuple[str, float]] = []
    for field, names in _SUMMED:
        for name in names:
            samples = _series(text, name)
            if samples:
                totals[field] = int(sum(_finite(v) for _, v in samples))
                if name == _MODEL_LABEL_SOURCE:
                    running_samples = samples
                break
    return totals, running_samples


def _inter_token_latency(text: str) -> tuple[float, int]:
    """The inter-token latency histogram's sum and count, over engines (0, 0 when absent)."""
    for name in _ITL_NAMES:
        counts = _series(text, name + "_count")
        if counts:
            total = sum(_finite(v) for _, v in _series(text, name + "_sum"))
            return total, int(sum(_finite(v) for _, v in counts))
    return 0.0, 0


def _kv_usage(text: str) -> float:
    """The KV-cache usage fraction, averaged over engines (0 when absent)."""
    for name in _KV_USAGE_NAMES:
        samples = _series(text, name)
        if samples:
            kv_usage = sum(_finite(v) for _, v in samples) / len(samples)
            # A fraction cannot exceed 1; a value above it was published in percent.
            if kv_usage > 1.0:
                kv_usage /= 100.0
            return min(max(kv_usage, 0.0), 1.0)
    return 0.0


def _lora_adapters(text: str) -> tuple[tuple[str, ...], tuple[str, ...], int | None]:
    """Running and waiting adapters and ``max_lora``, from the newest LoRA info series."""
    lora = _series(text, _LORA_INFO)
    if not lora:
        return (), (), None
    # The gauge is set to the current time on every step, once per label combination ever
    # seen; the newest series is the present state.
    labels = parse_labels(max(lora, key=lambda s: s[1])[0])
    return (
        _split_csv(labels.get("running_lora_adapters", "")),
        _split_csv(labels.get("waiting_lora_adapters", "")),
        _int_or_none(labels.get("max_lora", "")),
    )


def _cache_config(text: str) -> tuple[int | None, int | None]:
    """Block size and number of GPU blocks, when the server publishes its cache config."""
    cache = _series(text, _CACHE_INFO)
    if not cache:
        return None, None
    labels = parse_labels(cache[0][0])
    return (
        _int_or_none(labels.get("block_size", "")),
        _int_or_none(labels.get("num_gpu_blocks", "")),
    )


def _model_names(running_samples: list[tuple[str, float]]) -> tuple[str, ...]:
    """Distinct ``model_name`` label values, in order of appearance."""
    models: dict[str, None] = {}
    for label_text, _ in running_samples:
        model = parse_labels(label_text).get("model_name")
        if model:
            models[model] = None
    return tuple(models)


def _int_or_none(value: str) -> int | None:
    return int(value) if value.isdigit() else None


def _split_csv(value: str) -> tuple[str, ...]:
    return tuple(part for part in value.split(",") if part)
