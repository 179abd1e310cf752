"""CSV downloads a spreadsheet opens as data, never as formulas (CSV / formula injection).

Every CSV the control plane writes (the API's reports and statements, the console's exports)
goes through :func:`csv_attachment`. A cell whose text starts with ``=``, ``+``, ``-``, ``@``, a
tab or a carriage return is one a spreadsheet may evaluate (``=HYPERLINK(...)`` in a name an
edge reported or someone typed), so it is prefixed with a single quote, as OWASP advises: the
spreadsheet shows the text, the quote marks it as text. A plain number (``-1.5``, ``+3``) is
left alone, so a negative amount stays a number; it cannot be a formula.
"""

from __future__ import annotations

import csv
import io
import re
from collections.abc import Iterable, Mapping
from decimal import Decimal
from typing import Any

from django.http import HttpResponse

FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")
_PLAIN_NUMBER = re.compile(r"[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+)?")


def neutralise_cell(value: Any) -> Any:
    """``value`` as a spreadsheet should see it: text that could start a formula gets a
    leading ``'``; numbers, ``None`` and other text are returned as they are."""
    if value is None or isinstance(value, int | float | Decimal):
        return value
    text = value if isinstance(value, str) else str(value)
    if text.startswith(FORMULA_STARTS) and not _PLAIN_NUMBER.fullmatch(text):
        return "'" + text
    return text


def csv_text(rows: Iterable[Mapping[str, Any]]) -> str:
    """The rows as CSV with a header (the first row's keys), every cell neutralised; nothing
    for no rows."""
    out = io.StringIO()
    writer: csv.DictWriter[str] | None = None
    for row in rows:
        if writer is None:
            writer = csv.DictWriter(out, fieldnames=[neutralise_cell(k) for k in row])
            writer.writeheader()
        writer.writerow({neutralise_cell(k): neutralise_cell(v) for k, v in row.items()})
    return out.getvalue()


def csv_attachment(rows: Iterable[Mapping[str, Any]], name: str) -> HttpResponse:
    """A ``text/csv`` download of ``rows`` saved as ``<name>.csv``."""
    response = HttpResponse(csv_text(rows), content_type="text/csv; charset=utf-8")
    response["Content-Disposition"] = f'attachment; filename="{name}.csv"'
    return response
