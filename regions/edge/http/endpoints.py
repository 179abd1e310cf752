"""The client-facing routes the edge serves, each mapped to what it costs and how it travels.

vLLM's OpenAI-compatible server answers more than completions: the Responses API, embeddings
and the pooling routes of pooling models (score, rerank, classify, pooling), and the
tokenizer's ``/tokenize`` and ``/detokenize``. The edge serves each on the path the client
used, with one :class:`Endpoint` saying how: whether it generates (decode, a prefix cache worth
hashing, P/D), whether it takes a slot of the instance (tokenizer calls do not: they are cheap
and never queue), and whether the engine reports usage to meter. Dispatch is one dict lookup.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

Kind = Literal[
    "chat", "completions", "responses", "embeddings", "pooling", "tokenize", "detokenize"
]

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"


@dataclass(frozen=True, slots=True)
class Endpoint:
    """One route: ``path`` (the engine's, as the client called it), its kind, and what
    follows from the kind (plain fields: read on every request)."""

    path: str
    kind: Kind
    #: Decodes output tokens: the prompt's prefix is worth hashing, output is charged.
    generates: bool = field(init=False)
    #: Takes a slot of the instance (tokenizer calls go to any serving instance at once).
    queued: bool = field(init=False)
    #: The engine reports usage for it: usage records, budget holds and settlement.
    metered: bool = field(init=False)

    def __post_init__(self) -> None:
        queued = self.kind not in ("tokenize", "detokenize")
        object.__setattr__(self, "generates", self.kind in ("chat", "completions", "responses"))
        object.__setattr__(self, "queued", queued)
        object.__setattr__(self, "metered", queued)


CHAT = Endpoint(CHAT_PATH, "chat")
COMPLETIONS = Endpoint(COMPLETIONS_PATH, "completions")
RESPONSES = Endpoint("/v1/responses", "responses")
EMBEDDINGS = Endpoint("/v1/embeddings", "embeddings")
TOKENIZE = Endpoint("/tokenize", "tokenize")
DETOKENIZE = Endpoint("/detokenize", "detokenize")

#: Every POST route the edge serves (vLLM 0.32's api_server, pooling routes included).
ENDPOINTS: dict[str, Endpoint] = {
    e.path: e
    for e in (
        CHAT,
        COMPLETIONS,
        RESPONSES,
        EMBEDDINGS,
        Endpoint("/v2/embed", "embeddings"),  # Cohere's embed API, served by vLLM too
        TOKENIZE,
        DETOKENIZE,
        *(
            Endpoint(path, "pooling")
            for path in (
                "/pooling",
                "/classify",
                "/score",
                "/v1/score",
                "/rerank",
                "/v1/rerank",
                "/v2/rerank",
            )
        ),
    )
}
