"""The register of benchmarks: one declaration per benchmark, read by ``python -m bench``.

Each entry says what a reader of ``docs/benchmarks.md`` needs to find a benchmark's code and
figures: its CLI name, the module that runs it (imported only when it runs, so listing the
register starts no Django and needs no ``wrk``), what it measures in one line, its make target,
where its targets are stated, and its section and history in the docs. Adding a benchmark is one
entry here and a ``main(argv)`` in its module.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

DOC = "docs/benchmarks.md"
HISTORY = "docs/bench-history"


@dataclass(frozen=True)
class Benchmark:
    """One benchmark: how to run it and where its targets and results are written."""

    name: str
    module: str
    summary: str
    #: ``make`` target that runs it with the judged settings; empty when there is none.
    make: str
    #: Where the targets are stated (code first, else the docs); "none" for informative ones.
    targets: str
    #: Its history file under ``docs/bench-history/`` (several benchmarks may share one).
    history: str
    aliases: tuple[str, ...] = ()

    @property
    def doc(self) -> str:
        """Its section of the register page (an explicit anchor named after the benchmark)."""
        return f"{DOC}#{self.name}"

    @property
    def command(self) -> str:
        """The command a reader types: the make target if there is one."""
        return f"make {self.make}" if self.make else f"python -m bench {self.name}"

    def main(self) -> Callable[[list[str]], None]:
        """The module's ``main``, imported now: a benchmark's imports cost only when it runs."""
        entry: Callable[[list[str]], None] = importlib.import_module(self.module).main
        return entry

    def run(self, argv: list[str]) -> None:
        """Run it with its own flags (``argv`` as its module's ``main`` takes them)."""
        self.main()(argv)


REGISTER: tuple[Benchmark, ...] = (
    Benchmark(
        name="overhead",
        module="bench.overhead",
        summary="latency and CPU the edge hop adds to a direct engine call, vs the Rust router",
        make="bench-overhead",
        targets="bench/overhead.py: TARGETS, summarise()",
        history="overhead.md",
    ),
    Benchmark(
        name="routing",
        module="bench.routing_quality",
        summary="TTFT and cache hit rate of the edge's routing vs round robin, least-loaded, "
        "a session-hash oracle; several edges",
        make="bench-routing",
        targets="bench/harness/routing_report.py: targets(); bench/harness/routing_edges.py",
        history="routing.md",
        aliases=("routing_quality",),
    ),
    Benchmark(
        name="federation",
        module="bench.federation",
        summary="an inventory change until every edge applied it, and a region's evacuation, "
        "on the real control plane",
        make="bench-federation",
        targets="docs/benchmarks.md#federation (change -> every edge applied, p99 < 1 s)",
        history="federation.md",
    ),
    Benchmark(
        name="metering",
        module="bench.metering",
        summary="usage ingestion rate and a month's report time on PostgreSQL",
        make="bench-metering",
        targets="bench/metering.py: module docstring, render()",
        history="metering.md",
    ),
    Benchmark(
        name="console",
        module="bench.console",
        summary="the console's page times with a month of usage and 5,000 tenants",
        make="bench-console",
        targets="bench/console.py: TARGET_MS",
        history="console.md",
    ),
    Benchmark(
        name="failover",
        module="bench.failover",
        summary="engine death, region loss and a load step on the real control plane",
        make="bench-failover",
        targets="bench/failover.py: module docstring",
        history="failover.md",
    ),
    Benchmark(
        name="cold-start",
        module="bench.cold_start",
        summary="scale from zero: a cold model's first request to its first token",
        make="",
        targets="none (informative; a warm request in the same run is the baseline)",
        history="cold-start.md",
    ),
    Benchmark(
        name="instructions",
        module="bench.instructions",
        summary="metering's price at the edge in instructions per request (callgrind)",
        make="",
        targets="bench/overhead.py: TARGETS['metering_cpu_us_per_req_c64']",
        history="overhead.md",
    ),
    Benchmark(
        name="fleet-day",
        module="bench.fleet_day",
        summary="a simulated day of follow-the-sun traffic: GPU-hours and TTFT of static, "
        "reactive and fedinfer scaling",
        make="bench-fleet-day",
        targets="docs/benchmarks.md#fleet-day (>= 35 % fewer GPU-hours, >= 99 % within 2 s)",
        history="fleet-day.md",
    ),
    Benchmark(
        name="placement",
        module="bench.placement",
        summary="the placement planner's solve time on a synthetic fleet",
        make="",
        targets="none (informative; HiGHS stops at a 2 % gap or 30 s)",
        history="placement.md",
    ),
    Benchmark(
        name="prefix-tokens",
        module="bench.prefix_tokens",
        summary="what exact prefix matching costs per request: render, tokenize, hash, look up",
        make="",
        targets="none (informative)",
        history="prefix-tokens.md",
    ),
    Benchmark(
        name="compile-tables",
        module="bench.compile_tables",
        summary="compile time of every region's routing table on a 30-region synthetic fleet",
        make="",
        targets="bench/compile_tables.py: module docstring (< 2 s)",
        history="compile-tables.md",
    ),
    Benchmark(
        name="scale",
        module="bench.scale",
        summary="the control plane's growth: one change's compile, table sizes, what edges "
        "receive, heartbeat and usage ingestion, at 1x-8x of a 13-region fleet",
        make="",
        targets="bench/scale.py: module docstring, judge()",
        history="scale.md",
    ),
    Benchmark(
        name="admission",
        module="bench.admission",
        summary="the edge's admission CPU per request (key lookup, budget, two token buckets)",
        make="",
        targets="none (informative; parse_request in the same run is the baseline)",
        history="admission.md",
    ),
)

#: What ``python -m bench`` (``make bench``) runs with no name, in order.
DEFAULT: tuple[str, ...] = ("overhead", "routing")


def find(name: str) -> Benchmark | None:
    """The benchmark called ``name`` or one of its aliases; None if there is none."""
    for bench in REGISTER:
        if name == bench.name or name in bench.aliases:
            return bench
    return None


def render() -> str:
    """The register as an aligned table: name, make target, what it measures."""
    rows = [("benchmark", "make target", "measures")]
    for b in REGISTER:
        name = b.name + "".join(f" ({a})" for a in b.aliases)
        rows.append((name, b.make or "-", b.summary))
    wide = [max(len(r[i]) for r in rows) for i in range(2)]
    lines = [f"{r[0]:<{wide[0]}}  {r[1]:<{wide[1]}}  {r[2]}" for r in rows]
    lines.append("")
    lines.append("python -m bench NAME [flags]   (flags: python -m bench NAME -h)")
    lines.append(f"targets and latest results: {DOC}; past runs: {HISTORY}/")
    return "\n".join(lines)
