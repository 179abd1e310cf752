"""Self-calibrating prefill speeds: each instance's rate learned from what it does. Pure.

The table's ``prefill_tokens_per_s`` comes from the accelerator's figures (the compiler's
speed model); real engines differ from spec sheets and drift, and a wrong rate makes the
scheduler misjudge every expected TTFT (measured: the default figure instead of the engines'
real speed raised mean TTFT at ~90 % load by half). Apart from the RTT and the wait for a free
slot, the scheduler's expected TTFT of a request is inversely proportional to the instance's
rate — its queue, prefill and step terms all are — so ``used * predicted / observed`` is what
one answer says the instance's scale (rate = table figure * scale) really is.

Each streamed answer that was predicted without a slot wait, and did not wait at the gateway,
moves the *learned* scale toward that in log space by ``GAIN`` of the distance, each step
within ``1/MAX_STEP .. MAX_STEP`` and the scale within ``1/MAX_SCALE .. MAX_SCALE`` of the
table's figure (outliers — a GC pause, a preemption — move it little and never far). Times
under ``MIN_S`` are the edge's own overhead, not an engine's, and teach nothing.

The scheduler uses the learned scale only once it is more than ``HYSTERESIS`` away from the one
in use (:func:`in_use`): engines of one kind learn slightly different scales from noise, and
without the band that noise alone would rank identical engines and pile new requests on the
one that looked a little faster.
"""

from __future__ import annotations

import math

#: Share of the log-distance one observation moves the learned scale (~1/GAIN answers).
GAIN = 0.05
MAX_STEP = 1.25
MAX_SCALE = 8.0
MIN_S = 0.005
HYSTERESIS = 1.15


def learned(scale: float, used: float, predicted_s: float, observed_s: float) -> float:
    """The learned ``scale`` after one answer predicted ``predicted_s`` (its rate-bound part)
    at the scale ``used`` and observed ``observed_s``."""
    if predicted_s < MIN_S or observed_s < MIN_S:
        return scale
    target = used * predicted_s / observed_s
    step = math.exp(GAIN * math.log(target / scale))
    step = min(max(step, 1.0 / MAX_STEP), MAX_STEP)
    return min(max(scale * step, 1.0 / MAX_SCALE), MAX_SCALE)


def in_use(used: float, scale: float) -> float:
    """The scale the scheduler uses: ``used`` until the learned ``scale`` leaves its band."""
    if used / HYSTERESIS <= scale <= used * HYSTERESIS:
        return used
    return scale
