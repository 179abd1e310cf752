"""Self-calibrating prefill speeds: each instance's rate learned from what it does. Pure.

The table's ``prefill_tokens_per_s`` comes from the accelerator's figures (the compiler's
speed model); real engines differ from spec sheets and drift, and a wrong rate makes the
scheduler misjudge every expected TTFT (measured: the default figure instead of the engines'
real speed raised mean TTFT at ~90 % load by half). Apart from the RTT and the wait for a free
slot, the scheduler's expected TTFT of a request is inversely proportional to the instance's
rate — its queue, prefill and step terms all are — so ``used * predicted / observed`` is what
one answer says the instance's scale (rate = table figure * scale) really is.

Each streamed answer that was predicted without a slot wait, and did not wait at the gateway,
moves the instance's *learned* scale toward that in log space, each step within
``1/MAX_STEP .. MAX_STEP`` and the scale within ``1/MAX_SCALE .. MAX_SCALE`` of the table's
figure (outliers — a GC pause, a preemption — move it little and never far): by the running
mean of what its answers said until it has ``1/GAIN`` of them, then by ``GAIN`` of the
distance per answer. A step held at its bound is not counted in the mean, so a table 5x off
is followed in about eight answers (seventy with ``GAIN`` alone, to within 5 %). Times under
``MIN_S`` are the edge's own overhead, not an engine's, and teach nothing.

The scheduler's scale for an instance is its *kind's* scale times its own deviation from it
(``LoadBoard.learn`` in ``load.py``). A kind is the instances of one model with one table
figure; its scale is learned the same way from all their answers (each divided by its
instance's deviation), so a kind of eight learns eight times as fast, with the memory of one
instance. An instance's deviation is its own learned scale over the median of its kind's,
once it has ``1/GAIN`` answers (:func:`known`; before, it is taken to be as its kind),
and the one in use moves only once it leaves a ``HYSTERESIS`` band
(:func:`deviation_in_use`). Engines of one kind learn slightly different scales from noise:
without the band that noise alone would rank identical engines and pile new requests on the
one that looked a little faster. A figure wrong for the whole kind (the table's accelerator
figure, a driver, a quantisation) ranks nothing and is followed in full, not left up to the
band's width off as a band on the scale itself had left it (1.08-1.24 x the true speed in
the routing benchmark's 5x case).
"""

from __future__ import annotations

import math

#: Share of the log-distance one observation moves the learned scale (~1/GAIN answers).
GAIN = 0.05
MAX_STEP = 1.25
MAX_SCALE = 8.0
MIN_S = 0.005
HYSTERESIS = 1.15
#: A deviation back within this of its kind's is the kind's again (half the band, in log).
RETURN_BAND = math.sqrt(HYSTERESIS)


def answer_scale(used: float, predicted_s: float, observed_s: float) -> float | None:
    """The scale one answer says the instance has: predicted ``predicted_s`` (the rate-bound
    part of its expected TTFT) at the scale ``used``, observed ``observed_s``. None: the times
    are the edge's own overhead and say nothing of the engine."""
    if predicted_s < MIN_S or observed_s < MIN_S:
        return None
    return used * predicted_s / observed_s


def learned(scale: float, said: float, taught: int, gain: float = GAIN) -> tuple[float, int]:
    """The learned ``scale`` after an answer ``said`` another, and the answers it counts now
    (``taught`` before). A step held at its bound is not counted: the running mean starts
    from the first answer near the scale, not from the walk toward it."""
    # Plain comparisons, not min/max: this runs once per streamed answer, twice.
    share = gain if taught * gain >= 1.0 else 1.0 / (taught + 1)
    step = (said / scale) ** share
    counted = 1
    if step > MAX_STEP:
        step, counted = MAX_STEP, 0
    elif step * MAX_STEP < 1.0:
        step, counted = 1.0 / MAX_STEP, 0
    after = scale * step
    if after > MAX_SCALE:
        after = MAX_SCALE
    elif after * MAX_SCALE < 1.0:
        after = 1.0 / MAX_SCALE
    return after, taught + counted


def in_use(used: float, scale: float) -> float:
    """What the scheduler uses: ``used`` until the learned ``scale`` leaves its band."""
    if used / HYSTERESIS <= scale <= used * HYSTERESIS:
        return used
    return scale


def deviation_in_use(used: float, ratio: float) -> float:
    """The deviation from its kind the scheduler uses, from the learned ``ratio``: ``used``
    until the ratio leaves its band, and back to the kind's own (1.0) once within half the
    band of it, so identical engines that noise had once set apart are identical again."""
    if used != 1.0 and 1.0 / RETURN_BAND <= ratio <= RETURN_BAND:
        return 1.0
    return in_use(used, ratio)


def known(taught: int) -> bool:
    """Whether an instance's own scale is past its running mean's first, noisy answers and can
    tell it apart from its kind."""
    return taught * GAIN >= 1.0


def typical(scales: list[float]) -> float:
    """The typical scale of a kind's instances: their median, the upper one of an even count
    (one slow engine does not move it, so it alone deviates); 1.0 when none is known yet."""
    return sorted(scales)[len(scales) // 2] if scales else 1.0
