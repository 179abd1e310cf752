"""A simulated day of follow-the-sun traffic over three regions (`python -m bench fleet-day`).

A discrete-event replay, time compressed (a day in well under a minute per scaler): each
region's requests arrive as a Poisson process whose rate follows its local time of day; a
request takes one of its region's replicas' ``--slots`` concurrent slots for a log-normal
service time, or waits at the edge (FIFO) until one frees; its time to first token is that wait
plus ``--prefill-s``. A new replica serves only ``--cold-start-s`` after it is started; a
removed one takes no new requests and stops when its last one ends (drained). Every replica
costs GPU time from its start to its stop.

The scalers, each deciding per region:

* **static peak**: the replicas the day's busiest minute needs at the 65 % target, all day;
* **reactive, SkyServe's defaults**: replicas = ceil(requests/s over the last 60 s / the
  per-replica rate at the target), applied once it has asked for more for ``upscale_delay``
  (300 s) or for fewer for ``downscale_delay`` (1200 s), checked every 20 s;
* **reactive, Knative's KPA defaults**: replicas = ceil(mean concurrency over the 60 s stable
  window / 70 % of the slots), down at once; panic mode (the 6 s window asks for twice the
  replicas) scales up on the panic window and never down while it lasts (60 s);
* **fedinfer**: the worker's own policy, ``federation.fleet.autoscaler.autoscale_step`` (the
  code the ``fedinfer.fleet.autoscale`` task runs) with its default band, window and cooldown,
  on what an edge heartbeat reports (in flight and queued per replica) every
  ``--report-s`` seconds.

The model's assumptions are printed with the results and written to the JSON.
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import math
import random
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

from bench.harness.procs import git_rev, machine_info
from bench.harness.report import fmt, markdown_table, utc_now, write_result
from federation.fleet.autoscaler import (
    AutoscalePolicy,
    DeploymentLoad,
    Memory,
    ReplicaLoad,
    autoscale_step,
)

DAY_S = 86_400


@dataclass(frozen=True)
class Model:
    """The simulated world: demand, the replicas' capacity, cold start, the TTFT target."""

    peak_rps: float = 12.0  # requests/s of a region at its local peak
    trough_share: float = 0.1  # its rate at night, as a share of the peak
    peak_hour_local: float = 14.0
    #: UTC offsets of the three regions (us-east, eu-west, ap-southeast).
    utc_offsets: tuple[float, ...] = (-5.0, 1.0, 8.0)
    slots: int = 8  # requests one replica runs at once (max-num-seqs)
    service_mean_s: float = 4.0  # a request's time on a slot (prefill + decode)
    service_sigma: float = 0.6  # log-normal shape of that time
    prefill_s: float = 0.2  # time to first token once it has a slot
    ttft_target_s: float = 2.0
    cold_start_s: float = 90.0  # start -> ready (weights loaded, warmed)
    target_utilisation: float = 0.65
    max_replicas: int = 64
    #: Flash crowds: the rate times ``burst_factor`` for ``burst_minutes`` from each of these
    #: local hours (1.0: none, the default day is smooth).
    burst_factor: float = 1.0
    burst_minutes: float = 15.0
    burst_local_hours: tuple[float, ...] = (10.0, 15.0, 20.0)
    report_s: float = 5.0  # how often the fedinfer policy sees an edge report
    hours: float = 24.0
    seed: int = 7

    def rate(self, region: int, t: float) -> float:
        """Requests/s of ``region`` at ``t`` seconds past midnight UTC: a raised cosine
        (squared, so days are peaked and nights long) around the local peak hour."""
        local_h = (t / 3600 + self.utc_offsets[region]) % 24
        phase = math.cos(2 * math.pi * (local_h - self.peak_hour_local) / 24)
        shape = ((1 + phase) / 2) ** 2
        rate = self.peak_rps * (self.trough_share + (1 - self.trough_share) * shape)
        burst = any(0 <= local_h - h < self.burst_minutes / 60 for h in self.burst_local_hours)
        return rate * self.burst_factor if burst else rate

    @property
    def replica_rps(self) -> float:
        """Requests/s one replica serves at full load."""
        return self.slots / self.service_mean_s


@dataclass(eq=False)  # identity: two replicas with the same numbers are still two
class Replica:
    started: float
    ready_at: float
    in_flight: int = 0
    draining: bool = False
    stopped: float | None = None

    def ready(self, t: float) -> bool:
        return t >= self.ready_at


@dataclass
class Region:
    """One region's replicas, edge queue and tallies during the replay."""

    model: Model
    replicas: list[Replica] = field(default_factory=list)
    queue: deque[float] = field(default_factory=deque)
    requests: int = 0
    within: int = 0
    ttfts: list[float] = field(default_factory=list)
    arrivals_window: deque[float] = field(default_factory=deque)
    changes: int = 0

    def live(self) -> list[Replica]:
        return [r for r in self.replicas if r.stopped is None and not r.draining]

    def serving(self, t: float) -> list[Replica]:
        return [r for r in self.live() if r.ready(t)]

    def coming(self, t: float) -> int:
        return sum(1 for r in self.live() if not r.ready(t))

    def scale_to(self, n: int, t: float) -> None:
        """Add replicas (undraining warm ones first) or remove them (not-yet-ready ones
        first, then drain the least busy)."""
        live = self.live()
        if n == len(live):
            return
        self.changes += 1
        if n > len(live):
            missing = n - len(live)
            for r in self.replicas:
                if missing and r.draining and r.stopped is None:
                    r.draining = False
                    missing -= 1
            for _ in range(missing):
                self.replicas.append(Replica(started=t, ready_at=t + self.model.cold_start_s))
            return
        excess = len(live) - n
        for r in sorted(live, key=lambda r: (r.ready(t), r.in_flight)):
            if not excess:
                break
            excess -= 1
            if not r.ready(t) or r.in_flight == 0:
                r.stopped = t
            else:
                r.draining = True

    def gpu_seconds(self, end: float) -> float:
        return sum((r.stopped if r.stopped is not None else end) - r.started for r in self.replicas)


Scaler = Callable[[Region, float], None]


def static_scaler(peak_replicas: int) -> tuple[float, Scaler]:
    """Static provisioning: the peak's replicas all day, the baseline of the savings."""

    def decide(region: Region, t: float) -> None:
        region.scale_to(peak_replicas, t)

    return 60.0, decide


def skyserve_scaler(
    model: Model, upscale_delay_s: float = 300.0, downscale_delay_s: float = 1200.0
) -> tuple[float, Scaler]:
    """SkyServe's request-rate autoscaler with its default delays."""
    per_replica = model.replica_rps * model.target_utilisation
    state: dict[int, dict[str, float | None]] = {}

    def decide(region: Region, t: float) -> None:
        mine = state.setdefault(id(region), {"up": None, "down": None})
        while region.arrivals_window and region.arrivals_window[0] < t - 60:
            region.arrivals_window.popleft()
        target = max(1, math.ceil(len(region.arrivals_window) / 60 / per_replica))
        current = len(region.live())
        if target > current:
            mine["down"] = None
            mine["up"] = mine["up"] if mine["up"] is not None else t
            if t - mine["up"] >= upscale_delay_s:
                region.scale_to(min(target, model.max_replicas), t)
                mine["up"] = None
        elif target < current:
            mine["up"] = None
            mine["down"] = mine["down"] if mine["down"] is not None else t
            if t - mine["down"] >= downscale_delay_s:
                region.scale_to(target, t)
                mine["down"] = None
        else:
            mine["up"] = mine["down"] = None

    return 20.0, decide


def knative_scaler(model: Model, tick_s: float = 2.0) -> tuple[float, Scaler]:
    """Knative's KPA: 60 s stable window, 6 s panic window, panic at 200 %, 70 % target."""
    per_replica = model.slots * 0.7
    samples: dict[int, deque[tuple[float, int]]] = {}
    panic_until: dict[int, float] = {}

    def decide(region: Region, t: float) -> None:
        window = samples.setdefault(id(region), deque())
        window.append((t, sum(r.in_flight for r in region.replicas) + len(region.queue)))
        while window and window[0][0] < t - 60:
            window.popleft()
        stable = sum(c for _, c in window) / len(window)
        recent = [c for at, c in window if at >= t - 6]
        panic = sum(recent) / len(recent)
        current = len(region.live())
        want_stable = max(1, math.ceil(stable / per_replica))
        want_panic = max(1, math.ceil(panic / per_replica))
        if current and want_panic >= 2 * current:
            panic_until[id(region)] = t + 60
        if t < panic_until.get(id(region), 0.0):
            region.scale_to(min(model.max_replicas, max(current, want_panic)), t)
        else:
            region.scale_to(min(model.max_replicas, want_stable), t)

    return tick_s, decide


def fedinfer_scaler(model: Model, policy: AutoscalePolicy) -> tuple[float, Scaler]:
    """The worker's policy, fed what an edge heartbeat carries."""
    memories: dict[int, Memory] = {}

    def decide(region: Region, t: float) -> None:
        serving = region.serving(t)
        queued_each = len(region.queue) / len(serving) if serving else 0.0
        obs = DeploymentLoad(
            desired=len(region.live()),
            min_replicas=1,
            max_replicas=model.max_replicas,
            coming=region.coming(t),
            ready=[
                ReplicaLoad(
                    in_flight=r.in_flight,
                    queued=round(queued_each),
                    kv_cache_usage=0.0,
                    tokens_per_s=0.0,
                    max_concurrency=model.slots,
                    full_tokens_per_s=0.0,
                )
                for r in serving
            ],
            unreported=0,
            free_gpus=model.max_replicas,
            gpus_per_replica=1,
        )
        decision = autoscale_step(obs, memories.get(id(region), Memory()), now=t, policy=policy)
        memories[id(region)] = decision.memory
        region.scale_to(decision.desired, t)

    return model.report_s, decide


def arrivals(model: Model, region: int, rng: random.Random) -> Iterator[float]:
    """Poisson arrivals with the time-varying rate, second by second."""
    end = model.hours * 3600
    t = 0.0
    while t < end:
        n = _poisson(rng, model.rate(region, t))
        yield from sorted(t + rng.random() for _ in range(n))
        t += 1.0


def _poisson(rng: random.Random, lam: float) -> int:
    """Knuth's method (rates here are tens per second at most)."""
    limit, k, p = math.exp(-lam), 0, 1.0
    while True:
        p *= rng.random()
        if p <= limit:
            return k
        k += 1


def replay(model: Model, region_index: int, scaler: tuple[float, Scaler]) -> Region:
    """One region's day under one scaler."""
    tick_s, decide = scaler
    rng = random.Random(model.seed * 100 + region_index)
    service_rng = random.Random(model.seed * 100 + region_index + 50)
    mu = math.log(model.service_mean_s) - model.service_sigma**2 / 2
    region = Region(model)
    end = model.hours * 3600
    # The day starts warm: the replicas midnight's rate needs at the target, then the
    # scaler's own first decision (static peak adds its peak count here).
    first = model.rate(region_index, 0.0) / (model.replica_rps * model.target_utilisation)
    region.scale_to(max(1, math.ceil(first)), 0.0)
    decide(region, 0.0)
    for r in region.replicas:
        r.ready_at = 0.0
    done: list[tuple[float, int, Replica]] = []  # slot releases: (time, tie-break, replica)
    sequence = itertools.count()
    ready_events: list[float] = []
    next_tick = tick_s

    def dispatch(t: float) -> None:
        while region.queue:
            serving = region.serving(t)
            if not serving:
                return
            best = min(serving, key=lambda r: r.in_flight)
            if best.in_flight >= model.slots:
                return
            arrived = region.queue.popleft()
            ttft = t - arrived + model.prefill_s
            region.ttfts.append(ttft)
            region.within += ttft <= model.ttft_target_s
            best.in_flight += 1
            ends = t + service_rng.lognormvariate(mu, model.service_sigma)
            heapq.heappush(done, (ends, next(sequence), best))

    def release(t: float, r: Replica) -> None:
        r.in_flight -= 1
        if r.draining and r.in_flight == 0:
            r.stopped = t
        dispatch(t)

    def advance(until: float) -> None:
        """Everything but arrivals up to ``until``: slot releases, replicas becoming ready,
        scaler ticks, in time order."""
        nonlocal next_tick
        while True:
            candidates = [next_tick]
            if done:
                candidates.append(done[0][0])
            if ready_events:
                candidates.append(ready_events[0])
            t = min(candidates)
            if t > until:
                return
            if done and done[0][0] == t:
                _, _, replica = heapq.heappop(done)
                release(t, replica)
            elif ready_events and ready_events[0] == t:
                heapq.heappop(ready_events)
                dispatch(t)
            else:
                before = len(region.replicas)
                decide(region, t)
                for r in region.replicas[before:]:
                    heapq.heappush(ready_events, r.ready_at)
                next_tick += tick_s

    for at in arrivals(model, region_index, rng):
        advance(at)
        region.requests += 1
        region.arrivals_window.append(at)
        region.queue.append(at)
        dispatch(at)
    advance(end)
    # Requests still waiting at the end count with the wait they have had so far.
    for arrived in region.queue:
        ttft = end - arrived + model.prefill_s
        region.ttfts.append(ttft)
        region.within += ttft <= model.ttft_target_s
    return region


def peak_replicas(model: Model) -> int:
    """What static provisioning needs: the busiest minute's rate at the target utilisation
    (every region gets that many: each has the same day, at its own hours)."""
    peak = max(model.rate(0, minute * 60.0) for minute in range(24 * 60))
    return math.ceil(peak / (model.replica_rps * model.target_utilisation))


def run(model: Model) -> dict[str, Any]:
    """Replay the same day under every scaler: the same arrivals, so only the scaling differs."""
    policy = AutoscalePolicy(target=model.target_utilisation)
    scalers: dict[str, Callable[[], tuple[float, Scaler]]] = {
        "static peak": lambda: static_scaler(peak_replicas(model)),
        "reactive (SkyServe defaults: up 300 s, down 1200 s)": lambda: skyserve_scaler(model),
        "reactive (Knative KPA defaults: 60 s stable, 6 s panic)": lambda: knative_scaler(model),
        "fedinfer autoscaler": lambda: fedinfer_scaler(model, policy),
    }
    end = model.hours * 3600
    rows: dict[str, dict[str, Any]] = {}
    for name, make in scalers.items():
        regions = [replay(model, i, make()) for i in range(len(model.utc_offsets))]
        requests = sum(r.requests for r in regions)
        ttfts = sorted(t for r in regions for t in r.ttfts)
        rows[name] = {
            "gpu_hours": sum(r.gpu_seconds(end) for r in regions) / 3600,
            "requests": requests,
            "within_target": sum(r.within for r in regions) / max(1, requests),
            "ttft_p99_s": ttfts[int(0.99 * (len(ttfts) - 1))] if ttfts else 0.0,
            "scale_changes": sum(r.changes for r in regions),
        }
    static = rows["static peak"]["gpu_hours"]
    for row in rows.values():
        row["saving_vs_static"] = 1 - row["gpu_hours"] / static
    return {
        "date": utc_now(),
        "git": git_rev(),
        "machine": machine_info(),
        "model": asdict(model),
        "policy": asdict(policy),
        "static_replicas_per_region": peak_replicas(model),
        "results": rows,
    }


def report(result: dict[str, Any]) -> str:
    """The result as the Markdown table of docs/benchmarks.md."""
    rows = [
        [
            name,
            fmt(r["gpu_hours"], 1),
            f"{r['saving_vs_static']:.1%}",
            f"{r['within_target']:.3%}",
            fmt(r["ttft_p99_s"], 2),
            r["scale_changes"],
        ]
        for name, r in result["results"].items()
    ]
    model = result["model"]
    head = [
        "scaler",
        "GPU-hours",
        "fewer than static",
        "TTFT within target",
        "TTFT p99 s",
        "changes",
    ]
    return (
        markdown_table(head, rows)
        + f"\n\n{len(model['utc_offsets'])} regions, {model['hours']:g} h, "
        f"peak {model['peak_rps']:g} req/s per region, {model['slots']} slots x "
        f"{model['service_mean_s']:g} s per replica, cold start {model['cold_start_s']:g} s, "
        f"TTFT target {model['ttft_target_s']:g} s"
    )


def main(argv: list[str]) -> None:
    """Replay the day; print the table and write the JSON under var/bench/."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    defaults = Model()
    parser.add_argument("--peak-rps", type=float, default=defaults.peak_rps)
    parser.add_argument("--cold-start-s", type=float, default=defaults.cold_start_s)
    parser.add_argument("--slots", type=int, default=defaults.slots)
    parser.add_argument("--ttft-target-s", type=float, default=defaults.ttft_target_s)
    parser.add_argument("--hours", type=float, default=defaults.hours)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument(
        "--burst-factor",
        type=float,
        default=defaults.burst_factor,
        help="flash crowds: the rate times this for 15 min at 10:00, 15:00, 20:00 local",
    )
    opts = parser.parse_args(argv)
    model = Model(
        peak_rps=opts.peak_rps,
        cold_start_s=opts.cold_start_s,
        slots=opts.slots,
        ttft_target_s=opts.ttft_target_s,
        hours=opts.hours,
        seed=opts.seed,
        burst_factor=opts.burst_factor,
    )
    result = run(model)
    path = write_result("fleet_day", result)
    print(report(result))
    print(f"\nJSON: {path}")


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
