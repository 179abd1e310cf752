"""Seeded generator of a prefix-heavy, multi-turn chat workload.

The shape follows production chat traffic: a small set of long *system prompts* (an assistant
persona, tool descriptions, a policy: ~1-2k tokens each) shared by many users, each user opening
a *session* of several turns in which every turn resends the whole growing history
(system, user 1, assistant 1, ..., user k). Sessions start as a Poisson process; within a
session the next turn is sent after the previous answer arrived plus an exponential think time
(closed loop, as a person types). The popularity of the system prompts is uniform or Zipf-skewed
(a few assistants take most of the traffic).

Text is built from a seeded vocabulary of 3-letter words followed by a space: 4 bytes per word,
the documented 4 bytes per token of the edge and the simulator, so "tokens" here are words and
the sizes below are token counts. Assistant turns in the history are generated here too, not
taken from the engines' answers: the exact same requests are sent to every routing policy, so
policies are compared on identical input. With ``vocabulary="simulator"`` the words are the
simulator's own (``regions.engines.simulator.tokenizer``), each one token of the bench model's
real tokenizer (``bench.harness.tokenizer``): the workload for the edges' exact prefix path.

Everything is a pure function of :class:`WorkloadSpec` (its ``seed`` included): the same spec
gives the same workload, byte for byte.
"""

from __future__ import annotations

import bisect
import math
import random
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Literal

from regions.engines.simulator.tokenizer import _WORDS

__all__ = [
    "Session",
    "Turn",
    "Workload",
    "WorkloadSpec",
    "generate",
    "poisson_arrivals",
    "zipf_weights",
]

_LETTERS = "abcdefghijklmnopqrstuvwxyz"
#: Bytes per generated word ("token"): three letters and a space.
BYTES_PER_TOKEN = 4


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    seed: int = 1
    #: Sessions per second (Poisson) and the window in which sessions start.
    session_rate: float = 1.0
    duration_s: float = 60.0
    #: 0: a Poisson number of sessions at ``session_rate``; n > 0: exactly n, starting at
    #: sorted uniform times in the window (a Poisson process's arrivals given that n arrived),
    #: so that seeds differ in the draw but not in how many sessions they offer.
    sessions: int = 0
    n_system_prompts: int = 12
    system_tokens: tuple[int, int] = (1000, 2000)
    popularity: Literal["uniform", "zipf"] = "uniform"
    zipf_s: float = 1.1
    turns: tuple[int, int] = (3, 6)
    user_tokens: tuple[int, int] = (40, 160)
    reply_tokens: tuple[int, int] = (20, 60)
    think_time_mean_s: float = 1.0
    #: "letters": random 3-letter words (4 bytes a token, the byte estimate's rate);
    #: "simulator": the simulator's words, one token each of its bench tokenizer.
    vocabulary: Literal["letters", "simulator"] = "letters"

    def __post_init__(self) -> None:
        if self.session_rate <= 0 or self.duration_s <= 0:
            raise ValueError("session_rate and duration_s must be > 0")
        if self.sessions < 0:
            raise ValueError("sessions must be >= 0")
        if self.n_system_prompts < 1:
            raise ValueError("n_system_prompts must be >= 1")
        for name in ("system_tokens", "turns", "user_tokens", "reply_tokens"):
            lo, hi = getattr(self, name)
            if not 1 <= lo <= hi:
                raise ValueError(f"{name} must be 1 <= low <= high, got {(lo, hi)}")
        if self.vocabulary not in ("letters", "simulator"):
            raise ValueError(f"unknown vocabulary {self.vocabulary!r}")
        if self.popularity not in ("uniform", "zipf"):
            raise ValueError(f"unknown popularity {self.popularity!r}")

    @property
    def mean_turns(self) -> float:
        return (self.turns[0] + self.turns[1]) / 2

    @property
    def request_rate(self) -> float:
        """Expected requests per second once sessions overlap in steady state."""
        return self.session_rate * self.mean_turns


@dataclass(frozen=True, slots=True)
class Turn:
    user: str
    #: The assistant's answer as it appears in the *next* turn's history; also ``max_tokens``.
    reply: str
    max_tokens: int
    #: Pause after this turn's answer before the next turn is sent.
    think_s: float


@dataclass(frozen=True, slots=True)
class Session:
    id: str
    start_s: float
    system_idx: int
    turns: tuple[Turn, ...]


@dataclass(frozen=True, slots=True)
class Workload:
    spec: WorkloadSpec
    system_prompts: tuple[str, ...]
    sessions: tuple[Session, ...]
    popularity: tuple[float, ...] = field(default=())

    @property
    def n_requests(self) -> int:
        return sum(len(s.turns) for s in self.sessions)

    def messages(
        self, session: Session, turn: int, replies: list[str] | None = None
    ) -> list[dict[str, str]]:
        """The chat messages of ``session``'s turn ``turn`` (0-based): the whole history.

        ``replies`` (the answers the engines actually gave, as a real chat client resends
        them) replace the generated assistant turns where given.
        """
        msgs = [{"role": "system", "content": self.system_prompts[session.system_idx]}]
        for k, t in enumerate(session.turns[:turn]):
            reply = replies[k] if replies is not None and k < len(replies) else t.reply
            msgs.append({"role": "user", "content": t.user})
            msgs.append({"role": "assistant", "content": reply})
        msgs.append({"role": "user", "content": session.turns[turn].user})
        return msgs

    def prompt_tokens(self, session: Session, turn: int) -> int:
        """Approximate prompt size in tokens (message text only, without chat template)."""
        return sum(len(m["content"]) // BYTES_PER_TOKEN for m in self.messages(session, turn))


def _text(rng: random.Random, n_tokens: int, vocabulary: str = "letters") -> str:
    choice = rng.choice
    if vocabulary == "simulator":
        return "".join(choice(_WORDS) + " " for _ in range(n_tokens))
    return "".join(
        choice(_LETTERS) + choice(_LETTERS) + choice(_LETTERS) + " " for _ in range(n_tokens)
    )


def poisson_arrivals(rng: random.Random, rate: float, duration_s: float) -> list[float]:
    """Arrival times of a Poisson process of ``rate`` per second on ``[0, duration_s)``."""
    out: list[float] = []
    t = rng.expovariate(rate)
    while t < duration_s:
        out.append(t)
        t += rng.expovariate(rate)
    return out


def zipf_weights(n: int, s: float) -> list[float]:
    """Normalised Zipf popularity ``1/k^s`` of ranks ``k = 1..n``."""
    raw = [1.0 / math.pow(k, s) for k in range(1, n + 1)]
    total = sum(raw)
    return [w / total for w in raw]


def generate(spec: WorkloadSpec) -> Workload:
    """Build the workload of ``spec``; deterministic for a given spec."""
    # Independent streams, so that changing e.g. the arrival rate does not change the text.
    text_rng = random.Random(f"{spec.seed}:text")
    arrival_rng = random.Random(f"{spec.seed}:arrivals")
    session_rng = random.Random(f"{spec.seed}:sessions")

    system_prompts = tuple(
        f"[assistant {k}] "
        + _text(text_rng, text_rng.randint(*spec.system_tokens), spec.vocabulary)
        for k in range(spec.n_system_prompts)
    )
    if spec.popularity == "zipf":
        weights = zipf_weights(spec.n_system_prompts, spec.zipf_s)
    else:
        weights = [1.0 / spec.n_system_prompts] * spec.n_system_prompts
    cum = list(accumulate(weights))

    sessions = []
    if spec.sessions:
        starts = sorted(arrival_rng.random() * spec.duration_s for _ in range(spec.sessions))
    else:
        starts = poisson_arrivals(arrival_rng, spec.session_rate, spec.duration_s)
    for i, start in enumerate(starts):
        sys_idx = min(bisect.bisect_left(cum, session_rng.random() * cum[-1]), len(cum) - 1)
        turns = []
        for _ in range(session_rng.randint(*spec.turns)):
            n_reply = session_rng.randint(*spec.reply_tokens)
            turns.append(
                Turn(
                    user=_text(
                        session_rng, session_rng.randint(*spec.user_tokens), spec.vocabulary
                    ),
                    reply=_text(session_rng, n_reply, spec.vocabulary).rstrip(),
                    max_tokens=n_reply,
                    think_s=session_rng.expovariate(1.0 / spec.think_time_mean_s)
                    if spec.think_time_mean_s > 0
                    else 0.0,
                )
            )
        sessions.append(
            Session(
                id=f"s{spec.seed}-{i:05d}", start_s=start, system_idx=sys_idx, turns=tuple(turns)
            )
        )
    return Workload(
        spec=spec,
        system_prompts=system_prompts,
        sessions=tuple(sessions),
        popularity=tuple(weights),
    )
