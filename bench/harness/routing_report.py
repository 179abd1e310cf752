"""Targets and the Markdown summary of the routing benchmark (``bench/routing_quality.py``)."""

from __future__ import annotations

import math
from typing import Any

from bench.harness.report import checker, fmt, markdown_table
from bench.harness.routing_edges import edge_targets

#: The fedinfer edge with a table whose prefill speed is 5x the engines' real one: it must learn
#: the real speed (regions/edge/policy/speed.py). Run in the scenarios at >= 85 % load.
MISCALIBRATED = "fedinfer-speed5x"
#: How much slower a token may stream through the edge than with the oracle's placement.
ITL_ABOVE_ORACLE_MS = 0.2


def targets(results: dict[str, dict[str, Any]], edge_ratios: bool = True) -> dict[str, Any]:
    """One run's targets; without ``edge_ratios`` (one of several repetitions) the several
    edges' ratios to one edge are judged over the repetitions instead."""
    t: dict[str, Any] = {}
    f = results.get("fedinfer")
    if not f:
        return t
    check = checker(t)
    if "round_robin" in results:
        rr = results["round_robin"]["ttft_mean_s"]
        check("mean_ttft_vs_round_robin", f["ttft_mean_s"] / rr, 0.5, "<=")
    if "oracle" in results:
        check("mean_ttft_below_oracle_s", f["ttft_mean_s"], results["oracle"]["ttft_mean_s"], "<")
        check("hit_rate_vs_oracle", f["hit_rate"], results["oracle"]["hit_rate"], ">=")
        # Judged by the whole answer: a placement that wins TTFT by slowing every stream's
        # decode is a loss (issue 28 bounds the difference at 0.2 ms a token).
        o_itl, f_itl = results["oracle"].get("itl_mean_s"), f.get("itl_mean_s")
        if o_itl is not None and f_itl is not None:
            check("itl_above_oracle_ms", (f_itl - o_itl) * 1000, ITL_ABOVE_ORACLE_MS, "<=")
    if MISCALIBRATED in results:
        # The table's speed 5x off: within 15 % of the run with the true speed, once learned.
        ratio = results[MISCALIBRATED]["ttft_mean_s"] / f["ttft_mean_s"]
        check("mean_ttft_table_speed_5x_off_vs_true", ratio, 1.15, "<=")
    if "least_loaded" in results:
        # Tail with failed requests counted as never served: a 503 is not a fast answer.
        check(
            "p99_ttft_vs_least_loaded_s",
            f["ttft_p99_with_failures_s"],
            results["least_loaded"]["ttft_p99_with_failures_s"],
            "<=",
        )
    edge_targets(results, check, edge_ratios)
    return t


def _verdict(met: bool) -> str:
    return "met" if met else "MISSED"


def _ms(v: float) -> str:
    return "inf (failures)" if v == math.inf else fmt(v * 1000, 0)


def render(out: dict[str, Any]) -> str:
    """A routing result as the Markdown tables the benchmark prints."""
    m = out["machine_before"]
    lines = [
        f"machine: nproc={m['nproc']} {m['cpu_model']}; load avg before "
        f"{'/'.join(f'{x:.2f}' for x in m['loadavg'])}, after "
        f"{'/'.join(f'{x:.2f}' for x in out['machine_after']['loadavg'])}; git {out['git']}",
        "prefix knowledge: "
        + ("exact (tokenizer + KV events)" if out["config"].get("tokenizer") else "byte estimate")
        + "; several edges share live load: "
        + ("yes (Redis pub/sub)" if out["config"].get("peer_redis_url") else "no"),
    ]
    header = ["policy", "TTFT mean ms", "p50 ms", "p99 ms", "p99 incl. failures ms",
              "ITL mean ms", "engines' own step ms", "e2e mean ms", "req/s", "out tok/s",
              "hit rate", "max engine share", "errors/sent"]  # fmt: skip
    for name, s in out["scenarios"].items():
        cal = s["calibration"]
        lines += [
            "",
            f"### {name}: offered {s['offered_rps']:.2f} req/s = {s['scenario']['load']:.0%} of "
            f"measured capacity {cal['capacity_rps']:.2f} req/s; {s['workload']['sessions']} "
            f"sessions",
            "",
        ]
        rows = [
            [
                policy, _ms(r["ttft_mean_s"]), _ms(r["ttft_p50_s"]), _ms(r["ttft_p99_s"]),
                _ms(r["ttft_p99_with_failures_s"]), fmt(r.get("itl_mean_s", math.nan) * 1000, 2),
                fmt(r.get("engine_itl_mean_s", math.nan) * 1000, 2), _ms(r["e2e_mean_s"]),
                fmt(r["completed_per_s"], 2), fmt(r["output_tokens_per_s"], 0),
                fmt(r["hit_rate"], 3),
                fmt(r["max_engine_share"], 2), f"{r['errors']}/{r['sent']}",
            ]
            for policy, r in s["results"].items()
        ]  # fmt: skip
        lines.append(markdown_table(header, rows))
        trows = [
            [k, fmt(v["value"], 3), f"{v['op']} {fmt(v['bound'], 3)}", _verdict(v["met"])]
            for k, v in s["targets"].items()
        ]
        lines += ["", markdown_table(["target (fedinfer)", "value", "bound", "verdict"], trows)]
        for policy, r in s["results"].items():
            probe = r.get("rate_limit")
            if probe:
                lines.append(
                    f"\n{policy}: rate limit {probe['limit_rps']:g} req/s for "
                    f"{probe['seconds']:g} s through every edge in turn: {probe['admitted']} of "
                    f"{probe['sent']} admitted (bound {probe['bound']:g}, per edge "
                    f"{[e['admitted'] for e in probe['per_edge']]})"
                )
        if "fedinfer" in s["results"]:
            lines.append(f"\nfedinfer decisions: {s['results']['fedinfer']['route_reasons']}")
    for name, rep in out.get("several_edges", {}).items():
        lines += [
            "",
            f"### {name}, several edges over {rep['repetitions']} repetitions: one edge's mean "
            f"TTFT {', '.join(f'{v * 1000:.0f}' for v in rep['one_edge_mean_ttft_s'])} ms",
            "",
        ]
        trows = [
            [k, fmt(v["value"], 3), f"{v['op']} {fmt(v['bound'], 3)}", _verdict(v["met"])]
            for k, v in rep["targets"].items()
        ]
        lines.append(markdown_table(["target (pooled)", "value", "bound", "verdict"], trows))
        for policy, per in rep["per_run"].items():
            ratios = ", ".join(fmt(v, 3) for v in per["mean_ttft_vs_one_edge"])
            lines.append(f"\n{policy}: each repetition's mean TTFT x one edge's: {ratios}")
    for name, rep in out.get("repeated", {}).items():
        means = ", ".join(
            f"seed {seed}: {v * 1000:.0f} ms" for seed, v in rep["fedinfer_mean_ttft_s"].items()
        )
        lines += ["", f"### {name} over its seeds: fedinfer mean TTFT {means}", ""]
        trows = [
            [k, fmt(v["value"], 3) if "value" in v else "", _verdict(v["met"])]
            for k, v in rep["targets"].items()
        ]
        lines.append(markdown_table(["target (fedinfer)", "value", "verdict"], trows))
        oracle = ", ".join(
            f"seed {seed}: {v * 1000:.0f} ms" for seed, v in rep["oracle_mean_ttft_s"].items()
        )
        lines.append(
            f"\noracle mean TTFT {oracle}: spread {fmt(rep['oracle_mean_spread'], 3)}; "
            f"fedinfer / oracle spread {fmt(rep['fedinfer_over_oracle_spread'], 3)}"
        )
    return "\n".join(lines)
