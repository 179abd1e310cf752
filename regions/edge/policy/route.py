"""``x-fedinfer-route``: every answer says which path it took and why, formatted only here.

A single-hop answer names the winner with its score terms and the runner-up
(:func:`route_header`); a P/D answer both hops (:func:`pd_route`); a spilled answer keeps the
remote edge's header and adds where it came from (:func:`remote_route`).
"""

from __future__ import annotations

from typing import Protocol

from regions.edge.observability import CacheView
from regions.edge.policy.scheduler import Decision, Scored


class DecodeChoice(Protocol):
    """The decode hop's choice as the header shows it (``disagg.DecodePick``)."""

    @property
    def instance(self) -> str | None: ...
    @property
    def load(self) -> float: ...
    @property
    def runner_up(self) -> str | None: ...


def _terms(s: Scored) -> str:
    text = (
        f"ttft_ms:{s.ttft_s * 1000:.1f},queue_ms:{s.queue_s * 1000:.1f},"
        f"prefill_ms:{s.prefill_s * 1000:.1f},cached:{s.cached_tokens},load:{s.outstanding}"
    )
    if s.rate:
        # What the queue was (prefill ahead, wait for a slot) and the rate the score used: a
        # run gone wrong shows whether the line or the learned speed misled it.
        text += f",ahead_ms:{s.ahead_s * 1000:.1f},slot_ms:{s.slot_s * 1000:.1f},rate:{s.rate:.0f}"
    return text


def route_header(
    region: str,
    decision: Decision | None,
    retries: int,
    reason: str = "",
    view: CacheView | None = None,
) -> bytes:
    """Compact explanation, e.g. ``region=r;instance=i-3;score=ttft_ms:..;runner_up=i-1:40.2``.

    With ``view`` (a tenant's request), cache terms are limited to what that tenant sent."""
    if decision is None or decision.winner is None:
        why = reason or (decision.reason if decision else "none")
        return f"region={region};instance=none;reason={why};retries={retries}".encode()
    w = decision.winner if view is None else view.shown(decision.winner)
    text = (
        f"region={region};instance={w.instance};policy_reason={decision.reason};score={_terms(w)}"
    )
    r = decision.runner_up
    if r is not None:
        if view is not None:
            r = view.shown(r)
        text += f";runner_up={r.instance}:{r.ttft_s * 1000:.1f}"
    return f"{text};retries={retries}".encode()


def pd_route(
    region: str,
    mode: str,
    prefill: Scored | None,
    prefill_note: str,
    decode: DecodeChoice,
    kv: str,
    retries: int,
) -> bytes:
    """A P/D request: both hops and why, e.g. ``region=r;mode=pd;prefill=p-1;score=ttft_ms:..;
    decode=d-2;decode_load=0.125;kv=transferred;retries=0``."""
    text = f"region={region};mode={mode}"
    if prefill is not None:
        text += (
            f";prefill={prefill.instance};score=ttft_ms:{prefill.ttft_s * 1000:.1f},queue_ms:"
            f"{prefill.queue_s * 1000:.1f},prefill_ms:{prefill.prefill_s * 1000:.1f},cached:"
            f"{prefill.cached_tokens}"
        )
    else:
        text += ";prefill=none"
    if prefill_note:
        text += f";prefill_failed={prefill_note}"
    text += f";decode={decode.instance or 'none'};decode_load={decode.load:.3f}"
    if decode.runner_up is not None:
        text += f";decode_runner_up={decode.runner_up}"
    return f"{text};kv={kv};retries={retries}".encode("latin-1")


def prefill_refusal_route(region: str, instance: str, status: int) -> bytes:
    """A prefill engine refused the request (4xx), relayed as is: no decode hop ran."""
    return f"region={region};mode=pd;prefill={instance};decode=none;status={status}".encode(
        "latin-1"
    )


def remote_route(theirs: bytes, region: str, remote: str, why: str, rtt_s: float) -> bytes:
    """A remote edge's answer: its header, with where the request came from and why after
    the first part (``region=<remote>;remote_from=<here>;spill=ttft;rtt_ms=..;...``)."""
    head, _, rest = (theirs.decode("latin-1") or f"region={remote}").partition(";")
    route = f"{head};remote_from={region};spill={why};rtt_ms={rtt_s * 1000:.0f}"
    if rest:
        route += ";" + rest
    return route.encode("latin-1")


def spill_failed_route(region: str, why: str) -> bytes:
    """Every remote edge failed before its first byte, and the request cannot stay here."""
    return f"region={region};instance=none;reason=spill_failed;spill={why}".encode()


def route_field(header: bytes, name: str) -> str | None:
    """One field of a route header (``instance`` of ``region=r;instance=i-3;...``)."""
    prefix = name + "="
    for part in header.decode("latin-1").split(";"):
        if part.startswith(prefix):
            return part[len(prefix) :][:128]
    return None
