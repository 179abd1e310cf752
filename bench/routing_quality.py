"""Routing quality on a prefix-heavy multi-turn chat workload, four policies, one run.

Fleet (defaults): 8 simulated engines, each a Llama-70B-class model on 4 x L40S-48G (TP 4:
~2.5k prefill tokens/s, ~43 ms decode steps, 3k KV blocks = 48k tokens, so the KV cache is
under realistic pressure), ``max_num_seqs`` 16; one ``fedinfer engine-sim`` process per engine,
all pinned to CPU 1 (in one process, a busy engine's event loop delayed every engine's steps and
the edge's learned speeds chased that), the edge on CPU 0, this process's streaming client on
CPU 0. Workload:
:mod:`bench.harness.workload` (seeded): shared system prompts of 1-2k tokens, sessions of 3-6 turns
that resend the growing history, Poisson session arrivals, think time between turns.

Per scenario:

1. *Calibrate*: fresh engines, a closed loop of ``engines x max_num_seqs`` users sending the
   scenario's sessions back to back, session-affine, straight to the engines: the completed
   requests/s in steady state is the fleet's saturation throughput for this mix. With several
   seeds, every seed calibrates and all of them run at the mean capacity.
2. Set the Poisson session rate so the offered request rate is ``load x`` that capacity; with
   several seeds, every seed gets that rate's expected number of sessions.
3. For every policy, on fresh engines (cold caches) and a fresh edge: replay the identical
   workload; ``round_robin`` and ``least_loaded`` are the edge's ``--policy``; ``oracle`` is the
   client hashing the session id to an engine and sending directly; ``fedinfer`` is the edge's
   default policy. Requests sent in the first ``--warmup`` seconds fill caches and are not
   counted; no request is sent after ``--duration`` seconds, those in flight are awaited.
4. At >= 85 % load, ``fedinfer-speed5x``: the fedinfer edge again, its table claiming prefill
   5x faster than the engines' real speed, so it must learn the real one from the answers
   (``regions/edge/policy/speed.py``); target: mean TTFT within 15 % of the true-speed run.
5. ``fedinfer-2edges``, ``fedinfer-3edges``: two or three edges behind a per-request
   round-robin balancer, then one tenant sent over its rate limit through all of them
   (``bench/harness/routing_edges.py``); ``fedinfer-2workers``: one edge of two worker processes
   (``--workers 2``) on the edge's one core, the kernel spreading the client's connections.
   With ``--repeat`` they are judged on their means over the repetitions, not in each run.

With ``--exact-prefix`` every process runs on the bench model's real tokenizer: the engines
hash blocks as vLLM's ``sha256_cbor`` and publish KV events, the edges tokenize each prompt and
learn what every engine holds from those events (one view for several edges, the issue's
design), and the workload is written in the simulator's words (one token each).

Scenario ``skewed-90`` (4 engines, the top system prompt in over half of the sessions, 90 %
load, fedinfer against the session-hash oracle) runs once per seed, 1, 2 and 3 by default,
over 84 s of arrivals (its own duration: the others' 36 s left too few requests to judge a
difference of a few per cent), and is also judged across its runs; alone:
``python -m bench routing --scenario skewed-90``. Scenario ``fast-90`` is the same shape on fast
engines (an 8B model on one H100 each), with ``fedinfer-nolearn`` (the edge keeping the table's
speeds) beside the default edge: where a single edge was unstable near saturation.

Measured: TTFT (streaming, first content chunk) mean/p50/p90/p99, end-to-end latency,
completed requests/s and output tokens/s in the window, prefix-cache hit rate from the engines'
``/metrics`` deltas over the window (``vllm:prefix_cache_hits_total`` /
``vllm:prefix_cache_queries_total``), per-engine request share, errors, CPU of every process and
the client's event-loop lag (so a starved client shows instead of skewing TTFT).

    .venv/bin/python -m bench.routing_quality [--duration 36] [--warmup 12] [--seed 1]
        [--scenario skewed-90] [--seeds 1,2,3] [--repeat 3] [--exact-prefix]
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import uvloop

from bench.harness import routing_edges
from bench.harness.chat_client import Target, replay, saturate
from bench.harness.fleet import (
    Engines,
    start_edge,
    start_engines,
    tree_cpu_seconds,
    worker_ops,
    write_table,
)
from bench.harness.procs import VAR, bench_processes, git_rev, machine_info
from bench.harness.report import utc_now, write_result
from bench.harness.routing_report import MISCALIBRATED, render, targets
from bench.harness.routing_stats import edge_metrics, lag_stats, metric_delta, scrape, summarise
from bench.harness.tokenizer import build
from bench.harness.workload import Workload, WorkloadSpec, generate
from regions.engines.metrics import EngineLoad
from regions.supervisor import Process, Supervisor

POLICIES = (
    "round_robin", "least_loaded", "oracle", "fedinfer", "fedinfer-2edges", "fedinfer-3edges",
    "fedinfer-2workers",
)  # fmt: skip
MISCALIBRATION = 5.0
ENGINE_CPUS = {1}
EDGE_CPUS = {0}
CLIENT_CPUS = {0}


#: Edge flags of a policy beyond the default edge's: ``fedinfer-nolearn`` keeps the table's
#: prefill speeds (no learning from the answers), the comparison that shows what learning
#: costs. Run only when named in ``--policies``.
NO_LEARN = {"fedinfer-nolearn": ("--no-learn-speeds",)}


@dataclass(frozen=True)
class Scenario:
    name: str
    popularity: str
    load: float
    zipf_s: float = 1.1
    #: Engines (0: the config's), seeds run (empty: the config's seed), policies run (empty:
    #: every requested one), and whether the 5x-miscalibrated table runs at >= 85 % load.
    engines: int = 0
    seeds: tuple[int, ...] = ()
    policies: tuple[str, ...] = ()
    miscalibrated: bool = True
    #: Seconds of arrivals (0: the run's ``--duration``). A case judged on small differences
    #: needs a longer window: over 24 s (~375 requests on 4 engines) one seed's mean moved by
    #: up to 17 % between runs, and its comparison with the oracle with it.
    duration_s: float = 0.0
    #: The engines' model, accelerator and tensor-parallel size ("", 0: the config's).
    model: str = ""
    accelerator: str = ""
    tp: int = 0


SCENARIOS = (
    Scenario("uniform-60", "uniform", 0.60),
    Scenario("zipf-90", "zipf", 0.90),
    # Zipf(1.8) over 12 prompts gives the top one 58 % of the sessions; 4 engines at 90 %.
    Scenario("skewed-90", "zipf", 0.90, zipf_s=1.8, engines=4, seeds=(1, 2, 3),
             policies=("oracle", "fedinfer"), miscalibrated=False, duration_s=84.0),
    # The same shape on fast engines (an 8B model on one H100: ~8 ms decode steps, TTFTs of
    # tens of ms), where the edge's gateway line and its learned speeds weigh most: one run of
    # the edge here queued 69 % of requests at the gateway (mean TTFT 2.3x the oracle's) and
    # the next 52 % (1.26x); learning off 47 % (1.14x). Judged across its seeds, two edges
    # beside one (issue 28 asks them within 5 % of one here too).
    Scenario("fast-90", "zipf", 0.90, zipf_s=1.8, engines=4, seeds=(1, 2, 3),
             policies=("oracle", "fedinfer", "fedinfer-nolearn", "fedinfer-2edges"),
             duration_s=84.0,
             model="bench-llama-8b", accelerator="H100-80G", tp=1),
)  # fmt: skip


@dataclass(frozen=True)
class Config:
    engines: int = 8
    model: str = "bench-llama-70b"
    accelerator: str = "L40S"
    tp: int = 4
    max_num_seqs: int = 16
    seed: int = 1
    duration_s: float = 36.0
    warmup_s: float = 12.0
    calibrate_s: float = 14.0
    calibrate_warmup_s: float = 5.0
    n_system_prompts: int = 12
    think_time_mean_s: float = 1.0
    #: The table's per-instance ``max_concurrency`` (the edge's cap); 0 = ``max_num_seqs``,
    #: as the routing-table schema documents it.
    edge_cap: int = 0
    extra_engine_args: tuple[str, ...] = ()
    #: The bench model's tokenizer directory (``bench.harness.tokenizer``): the engines tokenize
    #: with it, hash blocks as vLLM's ``sha256_cbor`` and publish KV events; the edges tokenize with
    #: it and learn what every engine holds from those events (exact prefix knowledge, one view
    #: for several edges). Empty: the simulator's built-in tokenizer, the edges' byte estimate.
    tokenizer: str = ""
    #: Where several edges share their live load (``regions/edge/view/peer_load.py``); empty: not.
    peer_redis_url: str = routing_edges.PEER_REDIS_URL

    def engine_args(self) -> list[str]:
        args = ["--accelerator", self.accelerator, "--tp", str(self.tp), "--seed", str(self.seed)]
        args += ["--max-num-seqs", str(self.max_num_seqs), *self.extra_engine_args]
        if self.tokenizer:
            args += ["--tokenizer", self.tokenizer, "--prefix-caching-hash-algo", "sha256_cbor"]
        return args

    def edge_args(self) -> list[str]:
        return ["--tokenizer", f"{self.model}={self.tokenizer}"] if self.tokenizer else []


def base_spec(cfg: Config, sc: Scenario) -> WorkloadSpec:
    """The scenario's workload before calibration sets its session rate."""
    return WorkloadSpec(
        seed=cfg.seed,
        session_rate=1.0,
        duration_s=cfg.duration_s,
        n_system_prompts=cfg.n_system_prompts,
        popularity=sc.popularity,  # type: ignore[arg-type]
        zipf_s=sc.zipf_s,
        think_time_mean_s=cfg.think_time_mean_s,
        vocabulary="simulator" if cfg.tokenizer else "letters",
    )


# ---------------------------------------------------------------- runs


def _pin_self(cpus: set[int]) -> set[int]:
    before = os.sched_getaffinity(0)
    use = cpus & before
    if use:
        os.sched_setaffinity(0, use)
    return before


def _start_engines(pg: Supervisor, cfg: Config) -> Engines:
    """The bench's engines: one simulator process each, all on the engines' core."""
    return start_engines(
        pg,
        count=cfg.engines,
        model=cfg.model,
        extra=cfg.engine_args(),
        cpus=ENGINE_CPUS,
        process_each=True,
        kv_events=bool(cfg.tokenizer),
    )


def calibrate(cfg: Config, sc: Scenario, logdir: Path) -> dict[str, Any]:
    """Saturation throughput (requests/s) of the fleet for ``sc``'s mix."""
    spec = replace(base_spec(cfg, sc), session_rate=50.0, duration_s=60.0)
    workload = generate(spec)
    concurrency = cfg.engines * cfg.max_num_seqs
    with bench_processes(logdir / f"calibrate-{sc.name}") as pg:
        engines = _start_engines(pg, cfg)
        target = Target(tuple(engines.urls), "session_hash")
        before = _pin_self(CLIENT_CPUS)
        try:
            cpu0 = engines.cpu_seconds()
            t0 = time.monotonic()
            state = uvloop.run(
                saturate(
                    workload,
                    target,
                    model=cfg.model,
                    concurrency=concurrency,
                    duration_s=cfg.calibrate_s,
                )
            )
            engine_cpu = (engines.cpu_seconds() - cpu0) / (time.monotonic() - t0)
        finally:
            os.sched_setaffinity(0, before)
    lo, hi = cfg.calibrate_warmup_s, cfg.calibrate_s
    done = [r for r in state.records if not r.error and lo <= r.sent + r.e2e < hi]
    capacity = len(done) / (hi - lo)
    errors = sum(1 for r in state.records if r.error)
    print(
        f"[{sc.name}] capacity {capacity:.2f} req/s at {concurrency} concurrent "
        f"(engine CPU {engine_cpu:.2f}, client lag p99 {lag_stats(state)['p99_ms']:.1f} ms, "
        f"errors {errors})",
        flush=True,
    )
    return {
        "capacity_rps": capacity,
        "concurrency": concurrency,
        "window_s": [lo, hi],
        "errors": errors,
        "engine_cpu_share": engine_cpu,
        "client_lag": lag_stats(state),
        "mean_prompt_tokens": statistics.fmean(r.prompt_tokens for r in done) if done else None,
    }


def run_policy(
    cfg: Config, sc: Scenario, policy: str, workload: Workload, logdir: Path, tmp: Path
) -> dict[str, Any]:
    """One policy on fresh engines and edges: cold caches, so every policy starts alike."""
    with bench_processes(logdir / f"{sc.name}-{cfg.seed}-{policy}") as pg:
        engines: Engines = _start_engines(pg, cfg)
        edges: list[tuple[Process, str, str]] = []
        rate = prefill_rate(cfg) * (MISCALIBRATION if policy == MISCALIBRATED else 1.0)
        n_edges = routing_edges.edges_of(policy)
        workers = routing_edges.workers_of(policy)
        processes = n_edges * workers
        if policy == "oracle":
            target = Target(tuple(engines.urls), "session_hash")
        else:
            table = write_table(
                tmp / f"table-{sc.name}-{cfg.seed}-{policy}.json",
                engines,
                accelerator=cfg.accelerator,
                tp=cfg.tp,
                max_concurrency=cfg.edge_cap or cfg.max_num_seqs,
                prefill_tokens_per_s=rate,
                tenants=routing_edges.tenants("bench"),
                local_edges=n_edges,
            )
            edge_policy = policy if policy in ("round_robin", "least_loaded") else "fedinfer"
            edges = [
                start_edge(pg, table, policy=edge_policy, cpus=EDGE_CPUS, model=cfg.model,
                           name=f"edge{k}", admits=True, workers=workers,
                           extra=[*cfg.edge_args(), *NO_LEARN.get(policy, ()),
                                  *routing_edges.peer_args(cfg.peer_redis_url, processes,
                                                          tmp / "peer-keys")])
                for k in range(n_edges)
            ]  # fmt: skip
            if cfg.tokenizer:
                time.sleep(1.0)  # the edges' SUB sockets join before the engines' first event
            key = (("Authorization", f"Bearer {routing_edges.BENCH_KEY}"),)
            urls = tuple(url for _, url, _ in edges)
            if policy == routing_edges.IDLE_EDGES:
                urls = urls[:1]
            target = Target(urls, "per_request" if len(urls) > 1 else "single", key)
        snaps: dict[str, list[EngineLoad]] = {}
        cpu: dict[str, float] = {}

        def on_tick(t: float) -> None:
            if "warm" not in snaps and t >= cfg.warmup_s:
                snaps["warm"] = scrape(engines.urls)
                cpu["engines0"] = engines.cpu_seconds()
                cpu["edge0"] = sum(tree_cpu_seconds(e) for e, _, _ in edges) if edges else math.nan
                cpu["self0"] = time.process_time()
                cpu["t0"] = time.monotonic()

        before = _pin_self(CLIENT_CPUS)
        try:
            state = uvloop.run(
                replay(
                    workload,
                    target,
                    model=cfg.model,
                    stop_sending_s=cfg.duration_s,
                    on_tick=on_tick,
                )
            )
        finally:
            os.sched_setaffinity(0, before)
        end = scrape(engines.urls)
        edge_counters: dict[str, float] = {}
        for k, (_, _, ops0) in enumerate(edges):
            for w, ops in enumerate(worker_ops(ops0, workers)):
                for name, v in edge_metrics(ops, pg.log_dir / f"edge{k}.{w}-metrics.txt").items():
                    edge_counters[name] = edge_counters.get(name, 0.0) + v
        wall = time.monotonic() - cpu.get("t0", time.monotonic())
        edge_cpu = sum(tree_cpu_seconds(e) for e, _, _ in edges) if edges else None
        cpu_share = {
            "engines": (engines.cpu_seconds() - cpu.get("engines0", math.nan)) / wall,
            "edge": (edge_cpu - cpu["edge0"]) / wall if edge_cpu is not None else None,
            "client": (time.process_time() - cpu.get("self0", math.nan)) / wall,
        }
        probe = None
        if policy == "fedinfer" or processes > 1:
            urls = list(target.urls)
            probe = uvloop.run(routing_edges.probe_rate_limit(urls, cfg.model, processes))
    if "warm" not in snaps:
        raise RuntimeError(f"{sc.name}/{policy}: run ended before the warm-up snapshot")
    result = summarise(state.records, cfg.warmup_s, cfg.duration_s)
    result.update(metric_delta(snaps["warm"], end))
    result["cpu_share"] = cpu_share
    result["edge_counters"] = edge_counters
    result["client_lag"] = lag_stats(state)
    if probe is not None:
        result["rate_limit"] = probe
    print(
        f"[{sc.name}/{cfg.seed}] {policy:12s} TTFT mean {result['ttft_mean_s'] * 1000:7.1f} ms  "
        f"p50 {result['ttft_p50_s'] * 1000:7.1f}  p99 {result['ttft_p99_s'] * 1000:7.1f}  "
        f"ITL {result['itl_mean_s'] * 1000:.2f} ms  e2e {result['e2e_mean_s'] * 1000:.0f} ms  "
        f"hit {result['hit_rate']:.3f}  {result['completed_per_s']:.2f} req/s  "
        f"gateway wait {result['gateway_wait_mean_s'] * 1000:.1f} ms "
        f"({result['gateway_waited_share']:.0%} waited)  "
        f"errors {result['errors']}  engine share max {result['max_engine_share']:.2f}  "
        f"cpu { ({k: round(v, 2) if v is not None else None for k, v in cpu_share.items()}) }  "
        f"lag p99 {result['client_lag']['p99_ms']:.1f} ms",
        flush=True,
    )
    return result


def prefill_rate(cfg: Config) -> float:
    """The prefill rate the edge's table advertises: the simulator's own documented model for
    this accelerator and model size (what a control plane would compile into the table)."""
    from regions.engines.accelerators import accelerator
    from regions.engines.simulator.perf import PerfModel, model_params_billion

    perf = PerfModel(accelerator(cfg.accelerator), cfg.tp, model_params_billion(cfg.model))
    return float(perf.prefill_tokens_per_second())


def run(
    cfg: Config,
    scenarios: tuple[Scenario, ...] = SCENARIOS,
    policies: tuple[str, ...] = POLICIES,
    seeds: tuple[int, ...] = (),
    repeat: int = 1,
    duration_given: bool = False,
) -> dict[str, Any]:
    """Every scenario, ``repeat`` times per seed (``seeds``, else the scenario's, else
    ``cfg.seed``); repeats replay the same workload at the same rate on fresh processes.
    A scenario's own duration stands unless ``duration_given`` (``--duration``)."""
    started = utc_now()
    machine_before = machine_info()
    logdir = VAR / "logs" / "routing"
    tmp = Path(tempfile.mkdtemp(prefix="bench-routing-"))
    out: dict[str, Any] = {
        "benchmark": "routing_quality",
        "started": started,
        "git": git_rev(),
        "command": "python -m bench.routing_quality " + " ".join(sys.argv[1:]),
        "machine_before": machine_before,
        "config": asdict(cfg),
        "pinning": {
            "engines": sorted(ENGINE_CPUS),
            "edge": sorted(EDGE_CPUS),
            "client": sorted(CLIENT_CPUS),
        },
        "scenarios": {},
    }
    for sc in scenarios:
        duration = cfg.duration_s if duration_given or not sc.duration_s else sc.duration_s
        cfgs = {
            seed: replace(
                cfg,
                seed=seed,
                engines=sc.engines or cfg.engines,
                duration_s=duration,
                model=sc.model or cfg.model,
                accelerator=sc.accelerator or cfg.accelerator,
                tp=sc.tp or cfg.tp,
            )
            for seed in seeds or sc.seeds or (cfg.seed,)
        }
        cal = shared_calibration({seed: calibrate(c, sc, logdir) for seed, c in cfgs.items()})
        if len(cfgs) > 1:
            print(
                f"[{sc.name}] every seed at the mean capacity {cal['capacity_rps']:.2f} req/s",
                flush=True,
            )
        pooled = repeat > 1 and len(cfgs) == 1  # repetitions of one workload
        runs = {
            f"{seed}.{k}" if repeat > 1 else str(seed): run_scenario(
                c, sc, policies, logdir, tmp, cal, fixed_sessions=len(cfgs) > 1,
                edge_ratios=not pooled,
            )
            for seed, c in cfgs.items()
            for k in range(1, repeat + 1)
        }  # fmt: skip
        if len(runs) == 1:
            out["scenarios"][sc.name] = next(iter(runs.values()))
            continue
        for label, result in runs.items():
            out["scenarios"][f"{sc.name}@seed{label}"] = result
        if all({"oracle", "fedinfer"} <= r["results"].keys() for r in runs.values()):
            out.setdefault("repeated", {})[sc.name] = routing_edges.repeated_targets(runs)
        if pooled and any(routing_edges.several(p) for p in policies):
            out.setdefault("several_edges", {})[sc.name] = routing_edges.pooled_edge_targets(runs)
    out["finished"] = utc_now()
    out["machine_after"] = machine_info()
    path = write_result("routing_quality", out)
    print(render(out))
    print(f"\nresults: {path}")
    return out


def shared_calibration(per_seed: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """One capacity for every seed of a scenario: the mean of the seeds' calibrations.

    Why: each seed's own calibration differed by up to 30 % (and one seed's by 10 % between
    runs), so per-seed rates made the seeds' offered loads, not the routing, the spread."""
    if len(per_seed) == 1:
        return next(iter(per_seed.values()))
    return {
        "capacity_rps": statistics.fmean(c["capacity_rps"] for c in per_seed.values()),
        "per_seed": per_seed,
    }


def run_scenario(
    cfg: Config,
    sc: Scenario,
    policies: tuple[str, ...],
    logdir: Path,
    tmp: Path,
    cal: dict[str, Any],
    *,
    fixed_sessions: bool,
    edge_ratios: bool = True,
) -> dict[str, Any]:
    """Replay one workload at ``sc.load`` x ``cal``'s capacity with every policy, on fresh
    processes; with ``fixed_sessions`` the session count is the rate's expectation, the same
    for every seed; without ``edge_ratios`` the several edges are judged across repetitions."""
    request_rate = sc.load * cal["capacity_rps"]
    spec = replace(base_spec(cfg, sc), session_rate=request_rate / base_spec(cfg, sc).mean_turns)
    if fixed_sessions:
        spec = replace(spec, sessions=round(spec.session_rate * spec.duration_s))
    workload = generate(spec)
    top_share = sum(1 for s in workload.sessions if s.system_idx == 0) / len(workload.sessions)
    print(
        f"[{sc.name}/{cfg.seed}] offered {request_rate:.2f} req/s = {sc.load:.0%} of capacity; "
        f"{len(workload.sessions)} sessions, {workload.n_requests} requests, top prompt in "
        f"{top_share:.0%} of the sessions",
        flush=True,
    )
    run_policies = [p for p in policies if not sc.policies or p in sc.policies]
    if sc.miscalibrated and sc.load >= 0.85 and "fedinfer" in run_policies:
        run_policies.append(MISCALIBRATED)
    results = {p: run_policy(cfg, sc, p, workload, logdir, tmp) for p in run_policies}
    return {
        "scenario": asdict(sc),
        "seed": cfg.seed,
        "engines": cfg.engines,
        "calibration": cal,
        "offered_rps": request_rate,
        "workload": {
            "spec": asdict(spec),
            "sessions": len(workload.sessions),
            "requests": workload.n_requests,
            "system_prompt_share": list(workload.popularity),
            "top_prompt_session_share": top_share,
        },
        "results": results,
        "targets": targets(results, edge_ratios),
    }


def main(argv: list[str] | None = None) -> None:
    """Run the scenarios and policies asked; print the tables and write the JSON."""
    ap = argparse.ArgumentParser(
        prog="python -m bench.routing_quality", description=__doc__.split("\n")[0]
    )
    d = Config()
    ap.add_argument("--engines", type=int, default=d.engines)
    ap.add_argument("--model", default=d.model, help="size read from the name, e.g. 70b")
    ap.add_argument("--accelerator", default=d.accelerator)
    ap.add_argument("--tp", type=int, default=d.tp)
    ap.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument(
        "--duration",
        type=float,
        help=f"seconds of arrivals (default {d.duration_s:g}, or the scenario's own)",
    )
    ap.add_argument("--warmup", type=float, default=d.warmup_s, help="seconds not counted")
    ap.add_argument("--calibrate", type=float, default=d.calibrate_s, help="seconds of saturation")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--scenarios", "--scenario", default=",".join(s.name for s in SCENARIOS))
    ap.add_argument("--seeds", default="", help="e.g. 1,2,3: every scenario once per seed")
    ap.add_argument("--repeat", type=int, default=1, help="runs of every seed's workload")
    ap.add_argument("--edge-cap", type=int, default=0, help="table max_concurrency (0: seqs)")
    ap.add_argument("--engine-arg", action="append", default=[], help="extra engine-sim flag")
    ap.add_argument(
        "--exact-prefix",
        action="store_true",
        help="engines and edges on the bench model's real tokenizer, engines publishing KV "
        "events: the edges' exact prefix knowledge instead of the byte estimate",
    )
    ap.add_argument(
        "--peer-redis-url",
        default=d.peer_redis_url,
        help="several edges share their live load over this Redis ('': they do not)",
    )
    a = ap.parse_args(argv)
    duration_given = a.duration is not None
    if not duration_given:
        a.duration = d.duration_s
    if not 5 <= a.duration <= 300 or not 0 <= a.warmup < a.duration:
        ap.error("--duration must be 5..300 s and --warmup below it")
    cfg = Config(
        engines=a.engines,
        model=a.model,
        accelerator=a.accelerator,
        tp=a.tp,
        max_num_seqs=a.max_num_seqs,
        seed=a.seed,
        duration_s=a.duration,
        warmup_s=a.warmup,
        calibrate_s=a.calibrate,
        edge_cap=a.edge_cap,
        extra_engine_args=tuple(a.engine_arg),
        tokenizer=str(build(VAR / "bench-tokenizer")) if a.exact_prefix else "",
        peer_redis_url=a.peer_redis_url,
    )
    scen = tuple(s for s in SCENARIOS if s.name in a.scenarios.split(","))
    pols = tuple(
        p for p in a.policies.split(",") if p in (*POLICIES, routing_edges.IDLE_EDGES, *NO_LEARN)
    )
    unknown = set(a.scenarios.split(",")) - {s.name for s in SCENARIOS}
    if unknown or not scen:
        ap.error(f"unknown scenario(s) {sorted(unknown)}; known: {[s.name for s in SCENARIOS]}")
    try:
        seeds = tuple(int(x) for x in a.seeds.split(",") if x.strip())
    except ValueError:
        ap.error("--seeds takes integers, e.g. 1,2,3")
    if a.repeat < 1:
        ap.error("--repeat must be >= 1")
    run(cfg, scen, pols, seeds, a.repeat, duration_given)


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
