"""A deterministic stand-in tokenizer and chat template.

Real token ids do not matter to the simulator, but three properties of a real tokenizer do:
about four characters per token (so prompt lengths and prefill times are realistic), a
rendering of chat messages whose prefix is stable across turns (so multi-turn conversations
share KV-cache blocks, as with Llama 3's template), and generated text that re-tokenizes to the
same ids when a client sends it back as the assistant turn.
"""

from __future__ import annotations

import math
import random
import re
from array import array
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import xxhash

VOCAB_SIZE = 128_256
BOS = "<|begin_of_text|>"
SPECIAL_TOKENS: dict[str, int] = {
    BOS: 128_000,
    "<|end_of_text|>": 128_001,
    "<|start_header_id|>": 128_006,
    "<|end_header_id|>": 128_007,
    "<|eot_id|>": 128_009,
}
EOS_TOKEN_ID = SPECIAL_TOKENS["<|eot_id|>"]
#: The longest token's length in characters (vLLM bounds prompt text by limit x this).
MAX_CHARS_PER_TOKEN = max(len(s) for s in SPECIAL_TOKENS)
_ORDINARY_IDS = 128_000 - 256

# Words of at most six letters: each is exactly one token with or without a leading space.
_WORD_TEXT = (
    "the of and to in is that it was for on are as with his they at be this have from or one "
    "had by word but not what all were we when your can said there use an each which she do "
    "how their if will up other about out many then them these so some her would make like "
    "him into time has look two more write go see number no way could people my than first "
    "water been call who oil its now find long down day did get come made may part over new "
    "sound take only little work know place year live me back give most very after thing our "
    "just name good little man think say great where help through much before line right too "
    "mean old any same tell boy follow came want show also around form three small set put "
    "end does large must big even such turn here why ask went men read need land differ home "
    "us move try kind hand picture again change off play spell air away animal house point "
    "page letter mother answer found study still learn should world high every near add food "
    "between own below country plant last school father keep tree never start city earth eye "
    "light though head under story saw left few while along might close seem next hard open "
    "example begin life always those both paper group often run important until children "
    "side feet car mile night walk white sea began grow took river four carry state once book "
    "hear stop without second later miss idea enough eat face watch far really almost let "
    "above girl young talk soon list song being leave family"
)
_WORDS = tuple(dict.fromkeys(w for w in _WORD_TEXT.split() if len(w) <= 6))

_PIECE_RE = re.compile(
    "|".join(re.escape(s) for s in SPECIAL_TOKENS)
    + r"| ?[A-Za-z]{1,6}| ?[0-9]{1,3}| ?[^\sA-Za-z0-9]|\s*[\r\n]+|\s+(?!\S)|\s"
)


class Tokenizer:
    """Splits text into pieces (special tokens, <= 6-letter word chunks, 1-3 digit numbers,
    punctuation, newline runs, whitespace runs) and maps each piece to an id by hashing it.
    Newline runs are one piece wherever they stand, as in Llama 3's pre-tokenizer, so the
    ``\n\n`` ending a generation prompt is the same token when an answer follows it."""

    def __init__(self) -> None:
        self._cache: dict[str, int] = dict(SPECIAL_TOKENS)
        self._cache_limit = 1 << 18
        #: id -> piece of every piece cached (what ``/detokenize`` can turn back into text;
        #: ids are hashes, so the first piece seen keeps an id two pieces share).
        self._pieces: dict[int, str] = {tid: piece for piece, tid in SPECIAL_TOKENS.items()}
        # Output vocabulary: (id, text) of each word with and without a leading space.
        self.words: tuple[tuple[int, str], ...] = tuple(
            (self.piece_id(" " + w), " " + w) for w in _WORDS
        )
        self.first_words: tuple[tuple[int, str], ...] = tuple(
            (self.piece_id(w.capitalize()), w.capitalize()) for w in _WORDS
        )
        self.period: tuple[int, str] = (self.piece_id("."), ".")

    def piece_id(self, piece: str) -> int:
        tid = self._cache.get(piece)
        if tid is None:
            tid = 256 + xxhash.xxh32_intdigest(piece.encode()) % _ORDINARY_IDS
            if len(self._cache) < self._cache_limit:
                self._cache[piece] = tid
                self._pieces.setdefault(tid, piece)
        return tid

    def piece(self, tid: int) -> str | None:
        """The text of token ``tid`` (None: an id this tokenizer never produced)."""
        return self._pieces.get(tid)

    def decode(self, ids: Iterable[int]) -> str:
        """The text of token ids it produced; :class:`ValueError` names the first unknown id."""
        out = []
        for tid in ids:
            piece = self._pieces.get(tid)
            if piece is None:
                raise ValueError(f"token id {tid} is out of vocabulary")
            out.append(piece)
        return "".join(out)

    def encode(self, text: str) -> list[int]:
        get = self._cache.get
        piece_id = self.piece_id
        # Ids are never 0, so ``or`` only falls through on a cache miss.
        return [get(piece) or piece_id(piece) for piece in _PIECE_RE.findall(text)]

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        *,
        continue_final_message: bool = False,
    ) -> str:
        """Llama 3's template: every turn is delimited by special tokens, so the rendering of
        the first k turns is a prefix of the rendering of k+1 turns (prefix-cache friendly).
        ``continue_final_message`` leaves the last turn open (:func:`open_final_message`)."""
        if continue_final_message and add_generation_prompt:
            raise ValueError(CONTINUE_WITH_GENERATION_PROMPT)
        parts = [BOS]
        for message in messages:
            role = message.get("role")
            if not isinstance(role, str):
                raise ValueError("each message needs a string 'role'")
            parts.append(f"<|start_header_id|>{role}<|end_header_id|>\n\n")
            parts.append(message_text(message.get("content")))
            parts.append("<|eot_id|>")
        if add_generation_prompt:
            parts.append("<|start_header_id|>assistant<|end_header_id|>\n\n")
        rendered = "".join(parts)
        return open_final_message(rendered, messages) if continue_final_message else rendered


#: transformers' ``apply_chat_template`` refusals, which vLLM answers as 400s with their text.
CONTINUE_WITH_GENERATION_PROMPT = (
    "continue_final_message and add_generation_prompt are not compatible. Use "
    "continue_final_message when you want the model to continue the final message, and "
    "add_generation_prompt when you want to add a header that will prompt it to start a new "
    "assistant message instead."
)
FINAL_MESSAGE_NOT_RENDERED = (
    "continue_final_message is set but the final message does not appear in the chat after "
    "applying the chat template! This can happen if the chat template deletes portions of the "
    "final message. Please verify the chat template and final message in your chat to ensure "
    "they are compatible."
)


def open_final_message(rendered: str, messages: Sequence[Mapping[str, Any]]) -> str:
    """A chat rendered without generation prompt, cut right after its final message's text,
    so the model continues that message (no end-of-turn token, no new header): what
    transformers' ``apply_chat_template(continue_final_message=True)`` does, which vLLM calls.

    As transformers: the text looked for is the final message's stripped of surrounding
    whitespace, its last occurrence; trailing whitespace stays only where the template kept
    it and the message has no leading whitespace; a text the template dropped is an error."""
    if not messages:
        raise ValueError("list index out of range")  # transformers' ``chat[-1]``
    final = message_text(messages[-1].get("content"))
    stripped = final.strip()
    if stripped not in rendered:
        raise ValueError(FINAL_MESSAGE_NOT_RENDERED)
    at = rendered.rindex(stripped)
    kept = len(final.lstrip())
    if rendered[at : at + kept] == final:
        return rendered[: at + kept]
    return rendered[: at + len(stripped)]


def message_text(content: Any) -> str:
    """The text of a message ``content``: a string, or a list of parts whose text parts are
    joined by newlines (as vLLM does); ``None`` (assistant tool-call turns) is empty."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts: list[str] = []
        for part in content:
            if not isinstance(part, Mapping):
                raise ValueError("message content parts must be objects")
            if part.get("type") == "text":
                text = part.get("text")
                if not isinstance(text, str):
                    raise ValueError("a text content part needs a string 'text'")
                texts.append(text)
            else:
                raise ValueError(f"content part type {part.get('type')!r} is not supported")
        return "\n".join(texts)
    raise ValueError("message content must be a string or a list of parts")


def tokens_digest(token_ids: Iterable[int]) -> int:
    """A 64-bit digest of a token sequence (seeds the per-request output generator)."""
    return xxhash.xxh3_64_intdigest(array("I", token_ids).tobytes())


def plan_output(
    tokenizer: Tokenizer, rng: random.Random, length: int
) -> tuple[list[int], list[str]]:
    """``length`` output tokens of plausible text: a capitalised first word, then words, with a
    period about every twelve tokens. Re-tokenizing ``"".join(texts)`` gives the same ids."""
    if length <= 0:
        return [], []
    first_id, first_text = rng.choice(tokenizer.first_words)
    ids = [first_id]
    texts = [first_text]
    words = tokenizer.words
    period_id, period_text = tokenizer.period
    picks = rng.choices(words, k=length - 1)
    for i, (tid, text) in enumerate(picks, start=1):
        if i % 12 == 11:
            ids.append(period_id)
            texts.append(period_text)
        else:
            ids.append(tid)
            texts.append(text)
    return ids, texts


class OutputPlanner:
    """The simulated model's answers, cheap and deterministic.

    One pseudo-random text stream is drawn per seed at start-up; a request's answer is the
    window of that stream chosen by the digest of its prompt, so the same prompt gets the same
    answer (like greedy decoding) and planning costs a list slice, not a generator run. The
    length an answer would stop at by itself is log-normal around ``median`` (sigma 0.7); such
    an answer ends with the end-of-turn token, as a model's does.
    """

    STREAM_LEN = 1 << 16
    _LENGTHS = 4096

    def __init__(self, tokenizer: Tokenizer, seed: int, median: int):
        rng = random.Random(seed)
        self.ids, self.texts = plan_output(tokenizer, rng, self.STREAM_LEN)
        mu = math.log(max(median, 1))
        self.natural_lengths = [
            max(1, round(rng.lognormvariate(mu, 0.7))) for _ in range(self._LENGTHS)
        ]

    def plan(
        self, digest: int, max_tokens: int, *, ignore_eos: bool = False, min_tokens: int = 0
    ) -> tuple[list[int], list[str]]:
        if ignore_eos:
            length = max_tokens
        else:
            natural = self.natural_lengths[digest % self._LENGTHS]
            length = min(max_tokens, max(min_tokens, natural))
        start = (digest >> 12) % self.STREAM_LEN
        end = start + length
        if end <= self.STREAM_LEN:
            ids, texts = self.ids[start:end], self.texts[start:end]
        else:
            ids, texts = [], []
            while len(ids) < length:
                take = min(self.STREAM_LEN - start, length - len(ids))
                ids += self.ids[start : start + take]
                texts += self.texts[start : start + take]
                start = 0
        if length < max_tokens and ids:
            # Stopping by itself: the last token is the end-of-turn token, which counts as a
            # completion token but has no text (and is what the chat template appends to the
            # answer in the next turn, so the cache still matches).
            ids[-1], texts[-1] = EOS_TOKEN_ID, ""
        return ids, texts
