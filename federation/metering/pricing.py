"""What a request costs the tenant: a model's price list applied to its tokens. Pure, exact.

Prices are per million tokens with at most six decimals, so a request's price is an exact
decimal of at most twelve (``Decimal``, never a float): the sum of every request's price is the
price of the sum of their tokens, to the last token, whichever way a report groups them.
"""

from __future__ import annotations

from dataclasses import dataclass
from decimal import Decimal

MILLION = Decimal(1_000_000)
#: Digits after the point a price per million tokens may have (and a request price 2x that).
PRICE_DECIMALS = 6
ZERO = Decimal(0)


@dataclass(frozen=True, slots=True)
class Price:
    """USD per million tokens: fresh prompt tokens, prompt tokens served from the prefix
    cache, and generated tokens."""

    input_per_mtok: Decimal
    cached_input_per_mtok: Decimal
    output_per_mtok: Decimal


FREE = Price(ZERO, ZERO, ZERO)


def request_price(
    price: Price, *, prompt_tokens: int, cached_tokens: int, completion_tokens: int
) -> Decimal:
    """The tenant's price of one request, USD (exact)."""
    fresh = prompt_tokens - cached_tokens
    total = (
        fresh * price.input_per_mtok
        + cached_tokens * price.cached_input_per_mtok
        + completion_tokens * price.output_per_mtok
    )
    return total / MILLION
