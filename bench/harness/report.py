"""Small statistics and output helpers shared by the benchmarks."""

from __future__ import annotations

import datetime as dt
import json
import math
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bench.harness.procs import VAR


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile, ``q`` in 0..100 (NaN for no values)."""
    if not values:
        return math.nan
    xs = sorted(values)
    if len(xs) == 1:
        return float(xs[0])
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return float(xs[lo] + (xs[hi] - xs[lo]) * (pos - lo))


def spread(values: Sequence[float]) -> dict[str, float]:
    """Median, min and max of repeated measurements (the noise between runs)."""
    vals = [v for v in values if not math.isnan(v)]
    if not vals:
        return {"median": math.nan, "min": math.nan, "max": math.nan, "n": 0}
    return {
        "median": statistics.median(vals),
        "min": min(vals),
        "max": max(vals),
        "n": len(vals),
    }


#: Records one target: ``check(name, value, bound, op)``, ``op`` one of ``<=``, ``<``, ``>=``.
Check = Callable[[str, float, float, str], None]


def checker(into: dict[str, Any]) -> Check:
    """A :data:`Check` that records each target's value, bound and verdict in ``into``."""

    def check(name: str, value: float, bound: float, op: str) -> None:
        met = value <= bound if op == "<=" else value < bound if op == "<" else value >= bound
        into[name] = {"value": value, "bound": bound, "op": op, "met": bool(met)}

    return check


def fmt(v: float, nd: int = 2) -> str:
    """A number for a table, ``n/a`` for a missing one."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "n/a"
    return f"{v:.{nd}f}"


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Rows as a Markdown table: results are pasted into docs/benchmarks.md as printed."""
    out = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(out)


def write_result(name: str, data: dict[str, Any]) -> Path:
    """Write ``var/bench/<name>-<UTC stamp>.json`` and ``<name>-latest.json``; return the first."""
    VAR.mkdir(parents=True, exist_ok=True)
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ")
    path = VAR / f"{name}-{stamp}.json"
    text = json.dumps(data, indent=2, sort_keys=False, default=_default)
    path.write_text(text)
    (VAR / f"{name}-latest.json").write_text(text)
    return path


def _default(o: object) -> object:
    if isinstance(o, Path):
        return str(o)
    if isinstance(o, set | tuple):
        return list(o)
    raise TypeError(f"not JSON serialisable: {type(o)}")


def utc_now() -> str:
    """The current UTC time, as results and file names carry it."""
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
