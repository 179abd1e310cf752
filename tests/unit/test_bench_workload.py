"""The benchmark workload generator: deterministic, Poisson, prefix-sharing as specified."""

from __future__ import annotations

import random
import statistics
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest

from bench.harness.workload import (
    BYTES_PER_TOKEN,
    WorkloadSpec,
    generate,
    poisson_arrivals,
    zipf_weights,
)

SPEC = WorkloadSpec(seed=7, session_rate=2.0, duration_s=60.0)


def test_same_seed_same_workload_byte_for_byte() -> None:
    a, b = generate(SPEC), generate(SPEC)
    assert a == b
    assert [a.messages(s, len(s.turns) - 1) for s in a.sessions] == [
        b.messages(s, len(s.turns) - 1) for s in b.sessions
    ]


def test_other_seed_other_workload() -> None:
    a, b = generate(SPEC), generate(replace(SPEC, seed=8))
    assert a.system_prompts != b.system_prompts
    assert [s.start_s for s in a.sessions] != [s.start_s for s in b.sessions]


def test_rate_change_keeps_the_text() -> None:
    """Text and arrivals come from separate streams: a load change does not change prompts."""
    a, b = generate(SPEC), generate(replace(SPEC, session_rate=4.0))
    assert a.system_prompts == b.system_prompts
    assert len(b.sessions) > len(a.sessions)


def test_poisson_arrivals_have_the_requested_mean_rate() -> None:
    rng = random.Random(3)
    rate, duration = 20.0, 2000.0
    times = poisson_arrivals(rng, rate, duration)
    n = len(times)
    # Count of a Poisson process: mean rate*T, sd sqrt(rate*T) = 200; allow 4 sd.
    assert abs(n - rate * duration) < 4 * (rate * duration) ** 0.5
    gaps = [b - a for a, b in zip([0.0, *times], times, strict=False)]
    assert abs(statistics.fmean(gaps) - 1 / rate) < 0.02 / rate
    # Exponential gaps: the standard deviation equals the mean (coefficient of variation 1).
    assert abs(statistics.pstdev(gaps) / statistics.fmean(gaps) - 1.0) < 0.05
    assert times == sorted(times) and times[0] > 0 and times[-1] < duration


def test_generated_sessions_follow_the_rate() -> None:
    w = generate(replace(SPEC, session_rate=5.0, duration_s=400.0))
    expected = 5.0 * 400.0
    assert abs(len(w.sessions) - expected) < 4 * expected**0.5
    assert abs(w.spec.request_rate - 5.0 * 4.5) < 1e-9


def test_sessions_resend_their_growing_history() -> None:
    w = generate(SPEC)
    session = next(s for s in w.sessions if len(s.turns) >= 3)
    prev = w.messages(session, 0)
    assert [m["role"] for m in prev] == ["system", "user"]
    for k in range(1, len(session.turns)):
        cur = w.messages(session, k)
        # Each turn's prompt starts with the previous turn's prompt plus the answer to it.
        assert cur[: len(prev)] == prev
        assert cur[len(prev)] == {"role": "assistant", "content": session.turns[k - 1].reply}
        assert cur[-1] == {"role": "user", "content": session.turns[k].user}
        assert w.prompt_tokens(session, k) > w.prompt_tokens(session, k - 1)
        prev = cur


def test_sessions_share_system_prompts_of_the_specified_length() -> None:
    w = generate(SPEC)
    assert len(w.system_prompts) == SPEC.n_system_prompts
    assert len(set(w.system_prompts)) == SPEC.n_system_prompts
    lo, hi = SPEC.system_tokens
    for p in w.system_prompts:
        assert lo <= len(p) // BYTES_PER_TOKEN <= hi + 5
    used = Counter(s.system_idx for s in w.sessions)
    # Many sessions per system prompt: the prefix is shared across sessions.
    assert len(w.sessions) > 3 * SPEC.n_system_prompts
    assert min(used.values()) >= 2
    # Different sessions on one system prompt share exactly it as their first message.
    a, b = [s for s in w.sessions if s.system_idx == 0][:2]
    ma, mb = w.messages(a, 0), w.messages(b, 0)
    assert ma[0] == mb[0] and ma[1] != mb[1]
    # Session ids are unique; turn counts are within bounds.
    assert len({s.id for s in w.sessions}) == len(w.sessions)
    assert all(SPEC.turns[0] <= len(s.turns) <= SPEC.turns[1] for s in w.sessions)


def test_zipf_popularity_is_skewed_as_specified() -> None:
    spec = replace(SPEC, popularity="zipf", zipf_s=1.1, session_rate=20.0, duration_s=200.0)
    w = generate(spec)
    weights = zipf_weights(spec.n_system_prompts, spec.zipf_s)
    assert w.popularity == pytest.approx(weights)
    assert weights[0] / weights[1] == pytest.approx(2**1.1)
    counts = Counter(s.system_idx for s in w.sessions)
    n = len(w.sessions)
    for k in (0, 1, 5):
        share = counts[k] / n
        assert abs(share - weights[k]) < 4 * (weights[k] * (1 - weights[k]) / n) ** 0.5
    uniform = Counter(s.system_idx for s in generate(replace(spec, popularity="uniform")).sessions)
    assert counts.most_common(1)[0][1] > 2 * uniform.most_common(1)[0][1]


def test_invalid_specs_are_refused() -> None:
    with pytest.raises(ValueError):
        WorkloadSpec(session_rate=0)
    with pytest.raises(ValueError):
        WorkloadSpec(turns=(3, 2))
    with pytest.raises(ValueError):
        WorkloadSpec(popularity="pareto")  # type: ignore[arg-type]


def test_a_fixed_session_count_is_the_same_for_every_seed() -> None:
    """Repeated-seed runs offer every seed the same sessions; only the draw differs."""
    spec = replace(SPEC, sessions=120)
    a, b = generate(spec), generate(replace(spec, seed=8))
    assert len(a.sessions) == len(b.sessions) == 120
    assert [s.start_s for s in a.sessions] != [s.start_s for s in b.sessions]
    starts = [s.start_s for s in a.sessions]
    assert starts == sorted(starts) and starts[0] >= 0 and starts[-1] < SPEC.duration_s
    # Uniform over the window: each half holds about half (binomial sd ~5.5; 4 sd).
    assert abs(sum(1 for t in starts if t < SPEC.duration_s / 2) - 60) < 22
    assert generate(spec) == a


def test_the_simulator_vocabulary_is_one_bench_tokenizer_token_a_word(tmp_path: Path) -> None:
    """The exact-prefix bench sends the simulator's words: the bench model's real tokenizer
    makes each one token, so prompts keep the sizes the spec names."""
    from tokenizers import Tokenizer

    from bench.harness.tokenizer import build

    tokenizer = Tokenizer.from_file(str(build(tmp_path) / "tokenizer.json"))
    workload = generate(replace(SPEC, vocabulary="simulator"))
    system = workload.system_prompts[0].split("] ", 1)[1]
    words = len(system.split())
    assert SPEC.system_tokens[0] <= words <= SPEC.system_tokens[1]
    assert words <= len(tokenizer.encode(system).ids) <= words * 1.05
    letters = generate(SPEC).system_prompts[0].split("] ", 1)[1]
    assert len(tokenizer.encode(letters).ids) > 2 * len(letters.split())  # why it exists
    with pytest.raises(ValueError, match="vocabulary"):
        WorkloadSpec(vocabulary="greek")  # type: ignore[arg-type]
