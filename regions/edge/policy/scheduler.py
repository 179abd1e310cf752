"""The routing decision as a pure function: plain data in, a :class:`Decision` out, no I/O.

Inputs and outputs are plain slotted dataclasses (not frozen: a frozen dataclass costs ~3x to
build, and several are built per request); treat them as values. Two stages, as in the field
notes: *filter* (serves the model or adapter, right role, ready,
healthy, under its concurrency cap, not already tried) and *score* by the expected
time-to-first-token in seconds. The formula and the reasons for it are in
``docs/edge-scheduling.md``::

    cached   = min(matched_blocks * block_tokens, prompt_tokens - 1)   (or the exact tokens)
    busy     = max(outstanding, inflight) + queued      (max_concurrency when the KV cache is full)
    rate     = prefill_tokens_per_s
    shape    = 1 + decode_slowdown * min(1, busy / max_concurrency)
    step_s   = full_step_s * shape / (1 + decode_slowdown)     (measured: the engines' own
               inter-token gaps, per kind, ``speed.py``), until known step_tokens / rate * shape
    pending  = max(pending_tokens, waiting * mean_uncached_tokens)
    queue_s  = pending / rate + (step_s / 2 if busy > 0)
             + max(0, busy - max_concurrency + 1) * mean_service_s / max_concurrency
    ttft_s   = rtt_s + queue_s + (prompt_tokens - cached) / rate + step_s

where ``busy = max(outstanding, in-flight) + gateway waiters for the instance`` (in-flight: this
edge's requests, and the region's other edges' with peer sync, ``peer_load.py``). Under the
``fedinfer`` policy an instance at its cap stays a candidate (its slot wait is in ``queue_s``);
the decision then says ``wait`` and the request waits at the gateway for that instance.
Session affinity with hysteresis: the session's instance keeps the request while its expected
TTFT stays within ``affinity_factor * best + affinity_margin_s``, plus what moving costs the
streams running at the best instance and minus what staying costs those at its own (each:
running requests x the request's uncached tokens / rate, :func:`_slowed`): a placement is
judged by the whole answer, and a session that leaves re-prefills its history where every
running decode waits for it. A session this edge has not
placed before goes to its *home* (``sessions.home``: rendezvous hashing over the feasible
instances) while that is within ``best + affinity_margin_s``, so every edge of a region sends
it to the same place unless another instance is clearly sooner.

A new session's first turn also commits its later turns (they stick to its instance), which
the expected TTFT of this one request does not see: an instance with free seats looks only a
step slower however full it is. So a new session avoids an instance whose load
(``busy / max_concurrency``) is more than ``balance_abs`` above the least loaded one's *and*
more than ``balance_rel`` times it (SGLang's cache-aware router bounds imbalance with the same
pair of thresholds, in requests) *and* above ``balance_floor`` (below it the seats outlast the
session's turns); among the others the rules above apply, and a home beyond the bound is left
(``session_yield``). The bound itself is left (``balance_escape``) when the wait in line at
the best instance in bound is longer than the best expected TTFT overall.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from regions.edge.policy.sessions import home
from regions.edge.policy.speed import step_at

Policy = Literal["fedinfer", "round_robin", "least_loaded"]
POLICIES: tuple[Policy, ...] = ("fedinfer", "round_robin", "least_loaded")


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    policy: Policy = "fedinfer"
    #: Stick to the session's instance unless its TTFT exceeds factor * best + margin.
    affinity_factor: float = 1.5
    affinity_margin_s: float = 0.05
    #: One engine step reads the weights once: it costs about as much as prefilling this many
    #: tokens (roughly the accelerator's FLOP/byte ridge point; the simulator's model: ~100).
    step_tokens: float = 128.0
    #: A full batch of running decodes makes a step (1 + this) times as long as a lone one.
    decode_slowdown: float = 1.0
    #: KV-cache usage at which an engine has no room for another sequence.
    kv_full: float = 0.95
    #: ``fedinfer`` policy: an instance at its cap stays a candidate, scored with the wait
    #: for one of its slots, so a request may wait at the gateway for a warm instance when
    #: that is sooner than a cold prefill elsewhere.
    wait_for_warm: bool = True
    #: A new session skips instances loaded more than ``balance_abs`` (a share of their slots)
    #: above the least loaded one and more than ``balance_rel`` times its load, unless at most
    #: ``balance_floor`` of their slots are taken (seats to spare: nothing to bound).
    balance_abs: float = 0.25
    balance_rel: float = 1.5
    balance_floor: float = 0.75


@dataclass(slots=True)
class Candidate:
    """One instance as the scheduler sees it: static facts from the table plus live load."""

    id: str
    model: str
    adapters: tuple[str, ...]
    role: str
    state: str
    healthy: bool
    max_concurrency: int
    prefill_tokens_per_s: float
    #: Requests known in flight: this edge's, plus the other edges' with peer sync (the hard
    #: cap, and the wait at the gateway, apply to these).
    inflight: int
    #: Estimated requests on the engine from every edge (see ``load.py``).
    outstanding: int
    waiting: int
    kv_usage: float
    #: Uncached prompt tokens this edge sent that the engine has probably not computed yet.
    pending_tokens: float
    mean_uncached_tokens: float
    mean_service_s: float
    #: Leading prompt blocks this instance is believed to hold (prefix index).
    cached_blocks: int = 0
    #: Prompt tokens it holds per its KV events (``token_prefix.py``); None: not known
    #: exactly, ``cached_blocks`` estimates them.
    cached_tokens: int | None = None
    rtt_ms: float = 0.0
    #: Requests waiting at this edge's gateway for a slot of this instance.
    queued: int = 0
    #: What a full batch steps on this instance's kind, in seconds, as the engines' own
    #: inter-token latency says (``speed.py``); 0: not measured, derived from the rate.
    full_step_s: float = 0.0


@dataclass(slots=True)
class RouteRequest:
    model: str
    prompt_tokens: int
    #: Tokens per prefix-index block (block bytes / bytes per token).
    block_tokens: float
    sticky: str | None = None
    role: str = "mixed"
    exclude: frozenset[str] = frozenset()
    #: The session's key (``sessions.session_key``): without ``sticky``, its home is sticky.
    session: int | None = None


@dataclass(slots=True)
class Scored:
    instance: str
    ttft_s: float
    queue_s: float
    prefill_s: float
    cached_tokens: int
    outstanding: int
    #: No free slot now: the request waits at the gateway for this instance.
    wait: bool = False
    #: The part of ``queue_s`` that is the wait for a slot (not proportional to the rate).
    slot_s: float = 0.0
    #: ``cached_tokens`` came from the engine's KV events, not the byte estimate.
    exact: bool = False
    #: Requests on the instance per slot (``busy / max_concurrency``; 1 when the KV cache is full).
    load: float = 0.0
    #: The part of ``ttft_s`` the prefill rate does not explain: the RTT, the slot wait and a
    #: measured step's terms (what the speed learning takes off both sides, ``speed.py``).
    fixed_s: float = 0.0
    #: The part of ``queue_s`` that is prefill work ahead of this request (``pending / rate``).
    ahead_s: float = 0.0
    #: The prefill rate the score used, tokens/s (the table's figure as learned, ``speed.py``).
    rate: float = 0.0


@dataclass(slots=True)
class Decision:
    """``winner`` is None when nothing can take the request; ``reason`` says why.

    Reasons with a winner: ``best_ttft``, ``session``, ``session_yield`` (the session's
    instance was overloaded, or a new session's home beyond the balance bound),
    ``balance_escape`` (a new session left the bound: the line in bound was too long),
    ``round_robin``, ``least_loaded``. Without: ``unknown_model``,
    ``no_healthy_instance``, ``saturated`` (healthy instances exist but all are at their cap:
    the caller may queue and retry).
    """

    winner: Scored | None
    runner_up: Scored | None
    reason: str


def score(c: Candidate, req: RouteRequest, cfg: SchedulerConfig) -> Scored:
    """Expected TTFT of ``req`` on ``c`` in seconds, with its terms."""
    cap = c.max_concurrency
    busy = max(c.outstanding, c.inflight) + c.queued
    if c.kv_usage >= cfg.kv_full and busy < cap:
        busy = cap  # no free KV blocks: as good as no free slot
    rate = c.prefill_tokens_per_s
    # Prefill tokens cost 1/rate each however full the batch (chunked prefill shares the steps);
    # what the running decodes add is per step, whatever the prompt: the step in progress
    # finishes first, and the step that computes this prompt carries every running decode.
    measured = c.full_step_s > 0.0
    if measured:
        step_s = step_at(c.full_step_s, busy / cap, cfg.decode_slowdown)
    else:
        step_s = cfg.step_tokens / rate * (1.0 + cfg.decode_slowdown * min(1.0, busy / cap))
    # Two views of the prefill work ahead: what this edge sent and the engine has probably not
    # computed yet, and the engine's own waiting queue (every edge's); they overlap, so the max.
    pending = max(c.pending_tokens, c.waiting * c.mean_uncached_tokens)
    ahead_s = queue_s = pending / rate
    if busy > 0:
        queue_s += step_s / 2
    slot_s = 0.0
    if busy >= cap:
        slot_s = (busy - cap + 1) * c.mean_service_s / cap
        queue_s += slot_s
    exact = c.cached_tokens
    if exact is None:
        cached = min(int(c.cached_blocks * req.block_tokens), req.prompt_tokens - 1)
    else:
        cached = min(exact, req.prompt_tokens - 1)
    if cached < 0:
        cached = 0
    prefill_s = (req.prompt_tokens - cached) / rate + step_s
    rtt_s = c.rtt_ms / 1000.0
    ttft = rtt_s + queue_s + prefill_s
    fixed_s = rtt_s + slot_s
    if measured:
        fixed_s += 1.5 * step_s if busy > 0 else step_s
    return Scored(
        c.id,
        ttft,
        queue_s,
        prefill_s,
        cached,
        c.outstanding,
        c.inflight >= c.max_concurrency,
        slot_s,
        exact is not None,
        busy / cap,
        fixed_s,
        ahead_s,
        rate,
    )


def serves(c: Candidate, model: str) -> bool:
    return c.model == model or model in c.adapters


def decide(
    candidates: Sequence[Candidate], req: RouteRequest, cfg: SchedulerConfig, turn: int = 0
) -> Decision:
    """Pick the instance for ``req``; ``turn`` (a counter) rotates ties and round robin."""
    feasible = _feasible(candidates, req, cfg.policy == "fedinfer" and cfg.wait_for_warm)
    if isinstance(feasible, str):
        return Decision(None, None, feasible)

    n = len(feasible)
    start = turn % n
    order = feasible[start:] + feasible[:start]
    scored = [score(c, req, cfg) for c in order]

    if cfg.policy == "round_robin":
        return Decision(scored[0], _best(scored[1:]), "round_robin")
    if cfg.policy == "least_loaded":
        i = min(range(n), key=lambda k: order[k].outstanding / order[k].max_concurrency)
        rest = scored[:i] + scored[i + 1 :]
        return Decision(scored[i], _best(rest), "least_loaded")
    return _best_ttft(scored, req, cfg)


def _feasible(
    candidates: Sequence[Candidate], req: RouteRequest, may_wait: bool
) -> list[Candidate] | str:
    """The candidates that may take ``req``, or (none may) the reason why not."""
    feasible: list[Candidate] = []
    any_model = any_healthy = False
    for c in candidates:
        if not serves(c, req.model) or c.role != req.role:
            continue
        any_model = True
        if c.state != "ready" or not c.healthy or c.id in req.exclude:
            continue
        any_healthy = True
        if c.inflight >= c.max_concurrency and not may_wait:
            continue
        feasible.append(c)
    if feasible:
        return feasible
    return "saturated" if any_healthy else "no_healthy_instance" if any_model else "unknown_model"


def _best_ttft(scored: list[Scored], req: RouteRequest, cfg: SchedulerConfig) -> Decision:
    """The ``fedinfer`` policy: the smallest expected TTFT, unless the session's instance is
    close enough (``affinity_factor``, ``affinity_margin_s``); a new session only among the
    instances within the balance bound (:func:`_balanced`)."""
    sticky, factor = req.sticky, cfg.affinity_factor
    pool = scored
    escaped = False
    if sticky is None and req.session is not None:
        # Not placed by this edge yet: its home, the same at every edge, unless another
        # instance is sooner by more than the margin (a first turn pays no more than that).
        sticky, factor = home(req.session, [s.instance for s in scored]), 1.0
        pool, escaped = _balanced(scored, cfg)
    # Strict "<" over a rotated order: ties go round robin instead of to a fixed instance.
    best_i = 0
    for k in range(1, len(pool)):
        if pool[k].ttft_s < pool[best_i].ttft_s:
            best_i = k
    best = pool[best_i]
    if sticky is not None and sticky != best.instance:
        for s in scored:
            if s.instance == sticky:
                in_pool = pool is scored or any(p is s for p in pool)
                bar = best.ttft_s * factor + cfg.affinity_margin_s
                if req.sticky is not None:
                    bar += _slowed(best, req) - _slowed(s, req)
                if in_pool and s.ttft_s <= bar:
                    return Decision(s, best, "session")
                return Decision(best, s, "balance_escape" if escaped else "session_yield")
    reason = "session" if sticky == best.instance else "best_ttft"
    return Decision(best, _best([s for s in scored if s is not best]), reason)


def _slowed(s: Scored, req: RouteRequest) -> float:
    """Seconds the request's own prefill on ``s`` adds to the streams running there: each
    decode waits while those tokens compute. Leaving a session's instance re-prefills its
    history elsewhere; that cost falls on the other streams, not on its own TTFT."""
    if s.rate <= 0.0:
        return 0.0
    return s.outstanding * (req.prompt_tokens - s.cached_tokens) / s.rate


def _balanced(scored: list[Scored], cfg: SchedulerConfig) -> tuple[list[Scored], bool]:
    """The instances a new session may go to: all but those loaded more than ``balance_abs``
    above the least loaded one, more than ``balance_rel`` times its load and more than
    ``balance_floor`` (never empty); and whether the bound was left.

    The bound counts seats, not the prefill work queued for them: a burst of new sessions
    fills the least loaded instance's line with cold prefills while its seats are still
    free. When the wait in that line alone (the best in bound's ``queue_s``) is longer than
    the whole expected TTFT elsewhere, the bound is left: every instance may take it."""
    low = min(s.load for s in scored)
    bound = max(low + cfg.balance_abs, low * cfg.balance_rel, cfg.balance_floor)
    pool = [s for s in scored if s.load <= bound]
    if len(pool) == len(scored):
        return scored, False
    in_bound, overall = _best(pool), _best(scored)
    if in_bound is not None and overall is not None and in_bound.queue_s > overall.ttft_s:
        return scored, True
    return pool, False


def _best(scored: Sequence[Scored]) -> Scored | None:
    best: Scored | None = None
    for s in scored:
        if best is None or s.ttft_s < best.ttft_s:
            best = s
    return best


def decide_unqueued(
    candidates: Sequence[Candidate], model: str, exclude: frozenset[str], turn: int = 0
) -> Decision:
    """An instance for a call that takes no slot (``/tokenize``, ``/detokenize``): any ready,
    healthy instance serving ``model``, whatever its role and however full, the least loaded
    (outstanding per slot; ties rotate with ``turn``). Its terms are zero: nothing is queued
    or prefilled. Reason ``unqueued``; without a winner the same reasons as :func:`decide`."""
    feasible: list[Candidate] = []
    any_model = False
    for c in candidates:
        if not serves(c, model):
            continue
        any_model = True
        if c.state == "ready" and c.healthy and c.id not in exclude:
            feasible.append(c)
    if not feasible:
        return Decision(None, None, "no_healthy_instance" if any_model else "unknown_model")
    n = len(feasible)
    start = turn % n
    order = feasible[start:] + feasible[:start]
    ranked = sorted(order, key=lambda c: c.outstanding / c.max_concurrency)
    picked = [Scored(c.id, 0.0, 0.0, 0.0, 0, c.outstanding) for c in ranked[:2]]
    return Decision(picked[0], picked[1] if n > 1 else None, "unqueued")
