"""Exact cached prefixes: a prompt's vLLM block hashes looked up in what engines report holding.

For a model with a tokenizer (``regions/engines/prompt_tokens.py``),
:meth:`TokenPrefixes.prompt` turns a request into its token ids once;
:meth:`TokenPrefixes.cached_tokens` is then, per instance whose KV events are followed from a
known state (``kv_events.py``), the longest run of the prompt's block hashes the engine holds,
times its block size. Every edge subscribed to the same engines
computes the same number for the same request, without talking to the others.

One per-edge addition: the engine reports a prompt's blocks only once it has prefilled them,
so for :data:`RECENT_S` after this edge sent a prompt to an instance its blocks count as held
there too (a burst of one new prefix is not scattered over the fleet meanwhile).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter

from regions.edge.policy.prefix_index import PrefixIndex
from regions.edge.view.kv_events import SETTLE_S, EngineCache, KvEventHub
from regions.engines.block_hash import BlockMemo, block_hashes, none_hash
from regions.engines.prompt_tokens import ModelTokenizer, prompt_ids
from regions.tables.schema import Instance

log = logging.getLogger("fedinfer.edge.tokens")

#: The endpoints whose prompts the edge renders as vLLM does (not the Responses API).
TOKENIZED_KINDS = frozenset({"chat", "completions"})
#: Tokenizations waiting or running at most: past it a request is placed on the estimate
#: rather than delayed (a cold 2 000-token prompt takes a few ms, a seen one ~0.2 ms).
MAX_PENDING = 16
#: How long this edge's own routing of a prompt counts as the instance holding its blocks.
RECENT_S = SETTLE_S
#: Blocks of this edge's own recent routings remembered (an LRU over block hashes).
RECENT_CAPACITY = 50_000
#: A token-id prompt is cut to ``max_chars // CHARS_PER_ID`` ids, what the tokenizer's text
#: cut (``--tokenize-max-chars``) gives a text prompt: 64 KiB, about 16 k tokens of English.
CHARS_PER_ID = 4


def token_id_head(kind: str, doc: dict[str, Any], max_ids: int) -> dict[str, Any] | None:
    """A completion whose ``prompt`` is more than ``max_ids`` token ids, with its prompt cut to
    the first ``max_ids`` (the request the engine gets is unchanged); None for any other.

    The text path tokenizes at most ``--tokenize-max-chars`` characters of a prompt and hashes
    only that head's blocks; ids come tokenized, so without this cut a 4 MiB body of ids (two
    million) would be checked and hashed whole on the one tokenizer thread, holding up every
    other request's, and its blocks would flood this edge's record of recent routings."""
    if kind != "completions":
        return None
    prompt = doc.get("prompt")
    if not isinstance(prompt, list) or len(prompt) <= max_ids or isinstance(prompt[0], str):
        return None
    return {**doc, "prompt": prompt[:max_ids]}


@dataclass(slots=True)
class PromptTokens:
    """A prompt's token ids; its block hashes per block size, computed on first use."""

    ids: Sequence[int]
    #: All of the prompt was tokenized (not only its head: ``regions/engines/prompt_tokens.py``).
    complete: bool
    root: bytes
    cache_salt: str | None
    memo: BlockMemo | None = None
    _hashes: dict[int, list[int]] = field(default_factory=dict)

    def hashes(self, block_size: int) -> list[int]:
        """Hashes of the blocks a lookup can hit: vLLM always computes the last prompt token,
        so at most ``(len - 1) // block_size`` blocks."""
        out = self._hashes.get(block_size)
        if out is None:
            limit = max(len(self.ids) - 1, 0) // block_size
            out = self._hashes[block_size] = block_hashes(
                self.ids,
                block_size,
                self.root,
                cache_salt=self.cache_salt,
                max_blocks=limit,
                memo=self.memo,
            )
        return out


class TokenPrefixes:
    """The edge's tokenizers, the engines' reported blocks, and its own recent routings."""

    __slots__ = (
        "events",
        "failures",
        "memo",
        "pending",
        "recent",
        "root",
        "skipped",
        "tokenizers",
        "worker",
    )

    def __init__(
        self,
        tokenizers: Mapping[str, ModelTokenizer],
        events: KvEventHub,
        seed: str,
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.tokenizers = tokenizers
        self.events = events
        self.root = none_hash(seed)
        self.recent = PrefixIndex(RECENT_CAPACITY, RECENT_S)
        #: Block digests computed before (a prefix seen before is not hashed again).
        self.memo = BlockMemo()
        #: Prompts the tokenizer or template failed on unexpectedly (logged each time).
        self.failures = Counter(
            "fedinfer_edge_tokenize_failures",
            "Prompts the model's tokenizer or chat template failed on (placed on the estimate)",
            ["model"],
            registry=registry if registry is not None else CollectorRegistry(),
        )
        #: One thread: tokenizations run one at a time, off the event loop.
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fedinfer-tokenize")
        #: Tokenizations submitted and not finished; past :data:`MAX_PENDING` a request is
        #: placed on the estimate instead of waiting in line (``skipped`` counts them).
        self.pending = 0
        self.skipped = Counter(
            "fedinfer_edge_tokenize_skipped",
            "Requests placed on the estimate because the edge's tokenizer thread was busy",
            ["model"],
            registry=registry if registry is not None else CollectorRegistry(),
        )

    def close(self) -> None:
        self.worker.shutdown(wait=False, cancel_futures=True)

    def wants(self, model: str, kind: str) -> bool:
        """Is there a prompt to tokenize: a chat or completion, and a tokenizer for ``model``
        (an adapter's name has none: its blocks' keys hold the adapter's path)."""
        return kind in TOKENIZED_KINDS and model in self.tokenizers

    def prompt(
        self,
        model: str,
        kind: str,
        doc: dict[str, Any],
        salt: str | None,
        block_sizes: Iterable[int],
    ) -> PromptTokens | None:
        """The request's tokens with their hashes for ``block_sizes`` (in a worker thread:
        ~1 µs a token and ~5 µs a block, see docs/edge-scheduling.md), or None when the
        prompt is not rendered exactly. A template that fails on a request in a way it does
        not mean to (not its ``raise_exception``) is logged and counted; the request is then
        placed on the estimate rather than refused: the engine decides what it accepts."""
        tokenizer = self.tokenizers[model]
        head = token_id_head(kind, doc, max(1, tokenizer.max_chars // CHARS_PER_ID))
        try:
            prompt = prompt_ids(tokenizer, doc if head is None else head, kind)
        except Exception:
            self.failures.labels(model).inc()
            log.warning("tokenizing a %s request for %s failed", kind, model, exc_info=True)
            return None
        if prompt is None or not prompt.ids:
            return None
        complete = prompt.complete and head is None
        tokens = PromptTokens(prompt.ids, complete, self.root, salt, self.memo)
        for size in block_sizes:
            tokens.hashes(size)
        return tokens

    def block_sizes(self, instances: Iterable[Instance]) -> set[int]:
        """The block sizes the prompt will be looked up at on these instances."""
        sizes = set()
        for inst in instances:
            known = self.cache(inst)
            if known is not None:
                sizes.add(known[1])
        return sizes

    def cache(self, inst: Instance) -> tuple[EngineCache, int] | None:
        """The instance's reported cache and block size, when it can be trusted."""
        cache = self.events.known(inst.id)
        if cache is None:
            return None
        return cache, cache.block_size or inst.kv_block_tokens

    def cached_tokens(
        self, tokens: PromptTokens, inst: Instance, now: float, matched: dict[int, dict[str, int]]
    ) -> int | None:
        """Tokens of the prompt ``inst`` holds (None: not known exactly, use the estimate).
        ``matched`` memoises this edge's recent routings per block size across instances."""
        known = self.cache(inst)
        if known is None:
            return None
        cache, block_size = known
        hashes = tokens.hashes(block_size)
        if not hashes:
            return 0
        depth = cache.depth(hashes)
        if depth < len(hashes):
            recent = matched.get(block_size)
            if recent is None:
                recent = matched[block_size] = self.recent.match(hashes, now)
            depth = max(depth, recent.get(inst.id, 0))
        return depth * block_size

    def sent(self, tokens: PromptTokens, inst: Instance) -> None:
        """This edge sent the prompt to ``inst``: its blocks count as held there for a while."""
        known = self.cache(inst)
        if known is not None:
            hashes = tokens.hashes(known[1])
            if hashes:
                self.recent.insert(hashes, inst.id, time.monotonic())
