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

The decode step is not taken from the rate: the engines say it. Each reading of an engine's
``/metrics`` carries its inter-token latency histogram, and between two readings its sum over
its count is the engine's own mean step (:func:`step_interval`), at the batch it ran then;
kept as what a full batch steps (:func:`full_batch_step`, the prior's shape for the rest),
and taken per kind as its measured members' median, as the rate is: engines of one kind
measure slightly different steps from noise, which must not rank them, and a member not
measured yet is not made to look slower or faster than the others. The scheduler uses that
step where it is known, and the rate is learned only from what the step does not explain
(``Scored.fixed_s``). Why: derived from the rate, a full batch's step was taken to be twice a
lone one's, while on an 8B model on an H100 it is ~1.3x. Near saturation every prediction
carried that error, the learned rate absorbed it (25 % faster than the engines' true rate, in
the routing benchmark's fast-90), and moving a session, which re-prefills its history at that
rate, looked a quarter cheaper than it was.
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
#: Decode gaps two readings must be apart to say what a step takes (fewer: wait for more).
MIN_GAPS = 32
#: Share of the distance one interval's mean moves the measured step (a few readings' memory).
STEP_GAIN = 0.3
#: A mean step above this is not a step (a stalled engine, a broken exposition).
MAX_STEP_S = 10.0

#: An inter-token latency histogram as read: (sum of seconds, count of gaps).
Histogram = tuple[float, int]


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


def step_interval(seen: Histogram, now: Histogram) -> tuple[Histogram, float | None]:
    """The reading the next interval starts from, and this interval's mean inter-token gap
    (None: none taken). ``seen`` is where this one starts: an interval of fewer than
    ``MIN_GAPS`` gaps waits for more, and a count that went down (the engine restarted) starts
    again from ``now``."""
    gaps = now[1] - seen[1]
    if gaps < 0:
        return now, None
    if gaps < MIN_GAPS:
        return seen, None
    mean = (now[0] - seen[0]) / gaps
    return now, mean if 0.0 < mean < MAX_STEP_S else None


def full_batch_step(step_s: float, fill: float, slowdown: float) -> float:
    """The step of a full batch that a step of ``step_s`` at ``fill`` (running / cap) says,
    by the prior's shape (a step grows by ``slowdown`` from empty to full): the one unit
    the steps of an engine measured at any load, and of its kind's members, are kept in."""
    return step_s * (1.0 + slowdown) / (1.0 + slowdown * min(1.0, fill))


def step_at(full_step_s: float, fill: float, slowdown: float) -> float:
    """The step at ``fill`` of an engine whose full batch steps ``full_step_s``."""
    return full_step_s * (1.0 + slowdown * min(1.0, fill)) / (1.0 + slowdown)


def smoothed(value: float, sample: float) -> float:
    """``value`` moved by ``STEP_GAIN`` toward ``sample``; the first sample (value 0) stands."""
    return sample if value == 0.0 else value + STEP_GAIN * (sample - value)
