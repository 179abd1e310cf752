"""CSV cells that a spreadsheet could evaluate are written as text (OWASP CSV injection)."""

from __future__ import annotations

import csv
import io
from decimal import Decimal

import pytest

from federation.core.csv_export import csv_text, neutralise_cell


@pytest.mark.parametrize(
    "cell", ["=1+1", '=HYPERLINK("http://x","y")', "+1+1", "-2+3", "@SUM(A1)", "\tx", "\r=1", "-"]
)
def test_text_that_could_start_a_formula_gets_a_quote(cell: str) -> None:
    assert neutralise_cell(cell) == "'" + cell


@pytest.mark.parametrize(
    "cell", ["acme", "us-east/h100", "2026-11-30T14:00:00+00:00", "-1.5", "+3", "-2e-5", "", "a=b"]
)
def test_other_text_and_plain_numbers_are_left_alone(cell: str) -> None:
    assert neutralise_cell(cell) == cell


def test_numbers_and_none_are_left_alone() -> None:
    assert [neutralise_cell(v) for v in (-1, -0.5, Decimal("-2.25"), None)] == [
        -1, -0.5, Decimal("-2.25"), None,
    ]  # fmt: skip


def test_csv_text_neutralises_every_cell_and_its_header() -> None:
    text = csv_text([{"model": "=cmd", "@n": -3}, {"model": "ok", "@n": "-4"}])
    assert list(csv.reader(io.StringIO(text))) == [
        ["model", "'@n"], ["'=cmd", "-3"], ["ok", "-4"],
    ]  # fmt: skip
    assert csv_text([]) == ""
