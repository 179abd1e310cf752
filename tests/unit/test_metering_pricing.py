"""A request's price: fresh prompt, cached prompt and output tokens at their own rates, exact."""

from __future__ import annotations

from decimal import Decimal

from hypothesis import given
from hypothesis import strategies as st

from federation.metering.pricing import FREE, Price, request_price

PRICE = Price(Decimal("3.000001"), Decimal("0.3"), Decimal("15.123456"))


def test_each_kind_of_token_is_charged_at_its_rate() -> None:
    got = request_price(PRICE, prompt_tokens=1000, cached_tokens=400, completion_tokens=50)
    assert got == Decimal("0.0018000006") + Decimal("0.00012") + Decimal("0.0007561728")
    assert request_price(FREE, prompt_tokens=10, cached_tokens=0, completion_tokens=10) == 0


@given(
    st.lists(
        st.tuples(st.integers(0, 200_000), st.integers(0, 200_000), st.integers(0, 32_000)),
        max_size=50,
    )
)
def test_prices_add_up_exactly_whatever_the_grouping(requests: list[tuple[int, int, int]]) -> None:
    """The sum of the requests' prices is the price of their summed tokens, to the last digit:
    no rounding anywhere, so any report's totals reconcile with the rows under it."""
    rows = [(prompt + cached, cached, out) for prompt, cached, out in requests]
    each = sum(
        (
            request_price(PRICE, prompt_tokens=p, cached_tokens=c, completion_tokens=o)
            for p, c, o in rows
        ),
        start=Decimal(0),
    )
    total = request_price(
        PRICE,
        prompt_tokens=sum(r[0] for r in rows),
        cached_tokens=sum(r[1] for r in rows),
        completion_tokens=sum(r[2] for r in rows),
    )
    assert each == total
