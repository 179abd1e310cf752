"""What the routing benchmark measures of a run (``bench/routing_quality.py``): the engines'
counters before and after, the edges' own counters, and the client's view of every request
(TTFT, throughput, errors, route reasons) inside the measurement window."""

from __future__ import annotations

import math
import statistics
import urllib.request
from pathlib import Path
from typing import Any

from bench.harness.chat_client import Record, RunState
from bench.harness.report import percentile
from regions.engines.metrics import EngineLoad, parse_vllm_metrics


def scrape(urls: list[str]) -> list[EngineLoad]:
    """Every engine's ``/metrics``: the cache counters are read before and after a run."""
    out = []
    for u in urls:
        with urllib.request.urlopen(f"{u}/metrics", timeout=5) as r:
            out.append(parse_vllm_metrics(r.read().decode()))
    return out


def metric_delta(before: list[EngineLoad], after: list[EngineLoad]) -> dict[str, Any]:
    """The engines' counters over a run: hit rate and requests per engine."""

    def per_engine(field: str) -> list[Any]:
        return [getattr(a, field) - getattr(b, field) for b, a in zip(before, after, strict=True)]

    q = per_engine("prefix_cache_queries_total")
    h = per_engine("prefix_cache_hits_total")
    n = per_engine("request_success_total")
    p = per_engine("prompt_tokens_total")
    g = per_engine("generation_tokens_total")
    gaps = per_engine("inter_token_latency_seconds_count")
    gap_s = per_engine("inter_token_latency_seconds_sum")
    total_n = sum(n)
    return {
        "hit_rate": sum(h) / sum(q) if sum(q) else math.nan,
        "queries_tokens": sum(q),
        "hits_tokens": sum(h),
        "requests_per_engine": n,
        "max_engine_share": max(n) / total_n if total_n else math.nan,
        "hit_rate_per_engine": [hh / qq if qq else math.nan for hh, qq in zip(h, q, strict=True)],
        "prompt_tokens": sum(p),
        "generation_tokens": sum(g),
        # The engines' own step per token, over all of them and each: beside the client's ITL
        # it tells the relay's share of a gap from placement's (a fuller batch steps slower).
        "engine_itl_mean_s": sum(gap_s) / sum(gaps) if sum(gaps) else math.nan,
        "engine_itl_per_engine_s": [
            t / k if k else math.nan for t, k in zip(gap_s, gaps, strict=True)
        ],
    }


def edge_metrics(url: str, save: Path) -> dict[str, float]:
    """The edge's own counters worth reading next to the results (ejections, retries, ...)."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=5) as r:
        text = r.read().decode()
    save.write_text(text)
    wanted = ("fedinfer_edge_ejections_total", "fedinfer_edge_retries_total",
              "fedinfer_edge_midstream_failures_total", "fedinfer_edge_requests_total")  # fmt: skip
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        name, _, rest = line.partition("{") if "{" in line else line.partition(" ")
        if name in wanted:
            labels = rest.rsplit("}", 1)[0] if "}" in rest else ""
            key = name
            if name == "fedinfer_edge_requests_total":
                status = [x for x in labels.split(",") if x.startswith("status=")]
                key = f"{name}{{{status[0] if status else ''}}}"
            out[key] = out.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def summarise(records: list[Record], lo: float, hi: float) -> dict[str, Any]:
    """Stats over requests sent in ``[lo, hi)`` (the measurement window)."""
    window = [r for r in records if lo <= r.sent < hi]
    ok = [r for r in window if not r.error and r.status == 200]
    ttft = [r.ttft for r in ok]
    e2e = [r.e2e for r in ok]
    # Inter-token latency per answer (vLLM's TPOT): its decode time over the tokens after the
    # first. A placement that wins TTFT by slowing every stream's decode shows here.
    itl = [(r.e2e - r.ttft) / (r.completion_tokens - 1) for r in ok if r.completion_tokens > 1]
    # Throughput: every request that *completed* inside the window, whenever it was sent.
    done_in = [r for r in records if not r.error and r.status == 200 and lo <= r.sent + r.e2e < hi]
    span = hi - lo
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    reasons: dict[str, int] = {}
    for r in ok:
        for part in r.route.split(";"):
            if part.startswith("policy_reason="):
                key = part.removeprefix("policy_reason=")
                reasons[key] = reasons.get(key, 0) + 1
    # Failed requests never produced a token: counted as infinitely late for the tail.
    n_failed = len(window) - len(ok)
    ttft_with_failures = ttft + [math.inf] * n_failed
    errors: dict[str, int] = {}
    for r in window:
        if r.error or r.status != 200:
            key = f"{r.status} {r.error[:60]}".strip()
            errors[key] = errors.get(key, 0) + 1
    return {
        "sent": len(window),
        "ok": len(ok),
        "errors": sum(errors.values()),
        "error_kinds": errors,
        "ttft_mean_s": statistics.fmean(ttft) if ttft else math.nan,
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p90_s": percentile(ttft, 90),
        "ttft_p99_s": percentile(ttft, 99),
        "ttft_p99_with_failures_s": _p_inf(ttft_with_failures, 99),
        "route_reasons": reasons,
        # The part of TTFT spent in the edge's gateway line (0 for the oracle, no edge).
        "gateway_wait_mean_s": statistics.fmean(r.queue_s for r in ok) if ok else math.nan,
        "gateway_waited_share": sum(r.queue_s > 0.001 for r in ok) / len(ok) if ok else math.nan,
        "e2e_mean_s": statistics.fmean(e2e) if e2e else math.nan,
        "e2e_p99_s": percentile(e2e, 99),
        "itl_mean_s": statistics.fmean(itl) if itl else math.nan,
        "itl_p99_s": percentile(itl, 99),
        "sent_per_s": len(window) / span,
        "completed_per_s": len(done_in) / span,
        "output_tokens_per_s": sum(r.completion_tokens for r in done_in) / span,
        "client_cached_fraction": cached / prompt if prompt else math.nan,
        "mean_prompt_tokens": prompt / len(ok) if ok else math.nan,
    }


def _p_inf(values: list[float], q: float) -> float:
    """:func:`percentile` where infinite values (failed requests) sort last: the result is
    infinite as soon as the percentile reaches into them, and equal to ``percentile`` when
    nothing failed."""
    finite = sorted(v for v in values if v != math.inf)
    n_inf = len(values) - len(finite)
    if not n_inf:
        return percentile(finite, q)
    n = len(values)
    pos = (n - 1) * q / 100.0
    if math.ceil(pos) >= len(finite):
        return math.inf
    return percentile(finite, 100.0 * pos / (len(finite) - 1)) if len(finite) > 1 else finite[0]


def lag_stats(state: RunState) -> dict[str, float]:
    """The client's event-loop lag: a starved client shows here instead of skewing TTFT."""
    lags = state.lags
    return {
        "p50_ms": percentile(lags, 50) * 1000,
        "p99_ms": percentile(lags, 99) * 1000,
        "max_ms": max(lags) * 1000 if lags else math.nan,
    }
