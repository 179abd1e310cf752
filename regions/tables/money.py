"""Prices in exact integers, the same on both sides of a budget. Pure.

Prices per million tokens have at most six decimals of a dollar (micro-USD), so one request's
price is an exact integer of pico-USD (10^-12). The edge settles a request at that price and the
control plane counts the same record at the same price, so an edge's own sum and the control
plane's count of it never drift apart by rounding (``docs/adr/0008-budget-leases.md``).
"""

from __future__ import annotations

from decimal import Decimal

from regions.tables.schema import ModelPrice

#: pico-USD in one USD, and micro-USD (a price per million tokens' unit) in one USD.
PICO_PER_USD = 10**12
MICRO_PER_USD = 10**6


def request_pusd(
    price: ModelPrice, *, prompt_tokens: int, cached_tokens: int, completion_tokens: int
) -> int:
    """A request's price, pico-USD: per-million prices in micro-USD times tokens, exactly."""
    fresh = prompt_tokens - cached_tokens
    return (
        fresh * price.input + cached_tokens * price.cached_input + completion_tokens * price.output
    )


def micro_usd(amount: Decimal) -> int:
    """A price per million tokens in micro-USD; a finer amount is refused, not rounded."""
    micro = amount * MICRO_PER_USD
    if micro != micro.to_integral_value():
        raise ValueError(f"{amount} has more than six decimals")
    return int(micro)


def pico_usd(amount: Decimal) -> int:
    """An amount of USD in pico-USD, rounded down (a budget is never rounded up)."""
    return int((amount * PICO_PER_USD).to_integral_value(rounding="ROUND_FLOOR"))
