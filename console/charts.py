"""Report rows as chart series (uPlot's shape: one x axis, one list of values per series).
Pure: the rows come from the metering selectors."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import UTC, date, datetime, time
from decimal import Decimal
from typing import Any

#: Series drawn at most; the rest are summed into "other" so a chart stays readable.
MAX_SERIES = 8


def _epoch(moment: date | datetime) -> int:
    if not isinstance(moment, datetime):
        moment = datetime.combine(moment, time(0), tzinfo=UTC)
    return int(moment.timestamp())


def _number(value: Any) -> float:
    return float(value) if isinstance(value, int | float | Decimal) else 0.0


def chart_series(
    rows: Iterable[Mapping[str, Any]], *, time_key: str, group_key: str, metric: str
) -> dict[str, Any]:
    """``{"x": [epoch s], "series": [{"label", "values"}]}``, biggest groups first, a value
    for every x (0 where a group had none)."""
    totals: dict[str, float] = {}
    cells: dict[tuple[int, str], float] = {}
    xs: set[int] = set()
    for row in rows:
        x, label = _epoch(row[time_key]), str(row[group_key] or "—")
        value = _number(row.get(metric))
        xs.add(x)
        cells[(x, label)] = cells.get((x, label), 0.0) + value
        totals[label] = totals.get(label, 0.0) + value
    ranked = sorted(totals, key=lambda k: (-totals[k], k))
    shown, rest = ranked[:MAX_SERIES], ranked[MAX_SERIES:]
    axis = sorted(xs)
    series = [
        {"label": label, "values": [round(cells.get((x, label), 0.0), 6) for x in axis]}
        for label in shown
    ]
    if rest:
        series.append(
            {
                "label": f"other ({len(rest)})",
                "values": [round(sum(cells.get((x, k), 0.0) for k in rest), 6) for x in axis],
            }
        )
    return {"x": axis, "series": series}
