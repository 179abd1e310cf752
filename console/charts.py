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
    rows: Iterable[Mapping[str, Any]],
    *,
    time_key: str,
    group_key: str,
    metric: str,
    overall: Iterable[Mapping[str, Any]] | None = None,
    hidden: int = 0,
) -> dict[str, Any]:
    """``{"x": [epoch s], "series": [{"label", "values"}]}``, biggest groups first, a value
    for every x (0 where a group had none).

    Without ``overall`` the groups beyond :data:`MAX_SERIES` are summed into "other". With it
    (the same report by time bucket only), ``rows`` are the groups to draw and "other" is the
    rest of ``overall``: the ``hidden`` groups the caller left out.
    """
    totals: dict[str, float] = {}
    cells: dict[tuple[int, str], float] = {}
    xs: set[int] = set()
    for row in rows:
        x, label = _epoch(row[time_key]), str(row[group_key] or "—")
        value = _number(row.get(metric))
        xs.add(x)
        cells[(x, label)] = cells.get((x, label), 0.0) + value
        totals[label] = totals.get(label, 0.0) + value
    everything: dict[int, float] = {}
    for row in overall or ():
        x = _epoch(row[time_key])
        xs.add(x)
        everything[x] = everything.get(x, 0.0) + _number(row.get(metric))
    ranked = sorted(totals, key=lambda k: (-totals[k], k))
    shown, rest = (
        (ranked, []) if overall is not None else (ranked[:MAX_SERIES], ranked[MAX_SERIES:])
    )
    axis = sorted(xs)
    series = [
        {"label": label, "values": [round(cells.get((x, label), 0.0), 6) for x in axis]}
        for label in shown
    ]
    if overall is not None and hidden:
        series.append(
            {
                "label": f"other ({hidden})",
                "values": [
                    round(everything.get(x, 0.0) - sum(cells.get((x, k), 0.0) for k in shown), 6)
                    for x in axis
                ],
            }
        )
    elif rest:
        series.append(
            {
                "label": f"other ({len(rest)})",
                "values": [round(sum(cells.get((x, k), 0.0) for k in rest), 6) for x in axis],
            }
        )
    return {"x": axis, "series": series}
