"""A model's own tokenizer: a prompt's token ids as vLLM computes them.

With the ids, the edge computes the engine's block hashes (``regions/engines/block_hash.py``)
and looks them up in what the engines' KV events say they hold (``regions/edge/view/kv_events.py``):
exact prefix-cache knowledge, the same at every edge; the simulator, given the same files,
tokenizes as the edge and vLLM do. One :class:`ModelTokenizer` per model, loaded
from the ``tokenizer.json`` (fast ``tokenizers`` library) and ``tokenizer_config.json`` (the
chat template, rendered with jinja2 as Hugging Face's ``apply_chat_template`` renders it)
shipped with the deployment.

As vLLM 0.32 does (``vllm/renderers/hf.py``, the chat and completion request protocols'
``add_special_tokens`` defaults): a chat request's prompt is the template applied to the messages
(text parts of a message joined by ``\\n``; ``add_generation_prompt`` defaults to true) and
tokenized *without* adding special tokens (the template writes them); a completion's prompt
string is tokenized *with* them; token-id prompts are used as they are. What the edge cannot
render exactly returns None and the request falls back to the byte estimate: tools, non-text
parts, other template arguments, several prompts, message fields other than role/content/name.

Bounded (the edge tokenizes what clients send): at most ``max_chars`` characters of a rendered
prompt are tokenized. A longer prompt is cut there, and its tokens ending within
:data:`CUT_MARGIN_CHARS` of the cut are dropped (a token at the cut may differ from the whole
prompt's), so only its head's blocks are hashed.
"""

from __future__ import annotations

import json
import re
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, NamedTuple

import jinja2
import jinja2.ext
import jinja2.sandbox
from tokenizers import Tokenizer

#: Pieces of a chat prompt between added tokens this long or longer are remembered once
#: tokenized, and ids remembered at most (:class:`_Segments`: about 4 MB).
SEGMENT_MIN_CHARS = 64
SEGMENT_CACHE_TOKENS = 1 << 20
#: Characters of a rendered prompt tokenized at most (about 16 k tokens of English).
DEFAULT_MAX_CHARS = 64 * 1024
#: Tokens ending this close to a cut are dropped: a word at the cut may tokenize differently.
CUT_MARGIN_CHARS = 256
#: Message fields a plain chat turn has; anything else may change the rendering.
_MESSAGE_FIELDS = frozenset({"role", "content", "name"})
#: Chat request fields that change what the template renders (the edge does not render them).
_TEMPLATE_FIELDS = (
    "tools",
    "documents",
    "chat_template",
    "chat_template_kwargs",
    "continue_final_message",
    "add_special_tokens",
    "mm_processor_kwargs",
    "reasoning_effort",
)
_SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")


class Prompt(NamedTuple):
    """A prompt's token ids; ``complete`` is False when only its head was tokenized."""

    ids: Sequence[int]
    complete: bool


class TokenizerError(ValueError):
    """A tokenizer directory that cannot be loaded."""


def _token_text(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _template_env() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    """The environment Hugging Face renders chat templates in (``transformers``'
    ``_compile_jinja_template``): sandboxed, trimmed blocks, loop controls, ``tojson``,
    ``raise_exception`` and ``strftime_now``."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )

    def tojson(
        x: Any, ensure_ascii: bool = False, indent: Any = None, sort_keys: bool = False
    ) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, sort_keys=sort_keys)

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


class ModelTokenizer:
    """One model's tokenizer and chat template (``path``: a directory or a tokenizer.json)."""

    def __init__(self, path: Path, max_chars: int = DEFAULT_MAX_CHARS) -> None:
        directory = path if path.is_dir() else path.parent
        file = directory / "tokenizer.json" if path.is_dir() else path
        try:
            self._tok = Tokenizer.from_file(str(file))
        except Exception as exc:  # tokenizers raises plain Exception on a bad file
            raise TokenizerError(f"{file}: not a tokenizer.json ({exc})") from None
        self.max_chars = max_chars
        self.path = file
        self._encode = self._tok.encode_batch
        spec = json.loads(file.read_text())
        self._segments = _Segments(self._tok, spec) if _Segments.exact_for(spec) else None
        config: dict[str, Any] = {}
        config_file = directory / "tokenizer_config.json"
        if config_file.is_file():
            config = json.loads(config_file.read_text())
        template = config.get("chat_template")
        jinja_file = directory / "chat_template.jinja"
        if not isinstance(template, str) and jinja_file.is_file():
            template = jinja_file.read_text()
        self._render: Callable[..., str] | None = None
        if isinstance(template, str):
            self._render = _template_env().from_string(template).render
        self._specials = {
            name: text for name in _SPECIAL_NAMES if (text := _token_text(config.get(name)))
        }

    @property
    def has_chat_template(self) -> bool:
        return self._render is not None

    def encode(self, text: str, add_special_tokens: bool) -> Prompt:
        """Token ids of ``text``, only its first :attr:`max_chars` characters (see above)."""
        # encode_batch releases the GIL while it works (encode holds it): the edge tokenizes
        # in a worker thread, and its event loop goes on relaying meanwhile.
        if len(text) <= self.max_chars:
            return Prompt(self._encode([text], add_special_tokens=add_special_tokens)[0].ids, True)
        cut = self.max_chars
        enc = self._encode([text[:cut]], add_special_tokens=add_special_tokens)[0]
        keep = cut - CUT_MARGIN_CHARS
        ids = enc.ids
        offsets = enc.offsets
        n = len(ids)
        while n and offsets[n - 1][1] > keep:
            n -= 1
        return Prompt(ids[:n], False)

    def encode_chat(self, text: str) -> Prompt:
        """A rendered chat prompt's ids (no added special tokens): piece by piece from the
        segment cache where the tokenizer allows it (:class:`_Segments`), else whole."""
        segments = self._segments
        if segments is None or len(text) > self.max_chars:
            return self.encode(text, add_special_tokens=False)
        return Prompt(segments.encode(text), True)

    def chat_ids(self, doc: dict[str, Any]) -> Prompt | None:
        """The prompt ids of a chat request, or None when the edge cannot render it exactly."""
        render = self._render
        if render is None or any(doc.get(f) is not None for f in _TEMPLATE_FIELDS):
            return None
        # vLLM folds "developer" turns into the system turn for templates without that role.
        messages = doc.get("messages")
        if not isinstance(messages, list):
            return None
        conversation = []
        for m in messages:
            if not isinstance(m, dict) or not _MESSAGE_FIELDS.issuperset(m):
                return None
            text = _message_text(m.get("content"))
            if text is None or not isinstance(m.get("role"), str) or m["role"] == "developer":
                return None
            turn = {"role": m["role"], "content": text}
            if isinstance(m.get("name"), str):
                turn["name"] = m["name"]
            conversation.append(turn)
        add_generation_prompt = doc.get("add_generation_prompt", True)
        if not isinstance(add_generation_prompt, bool):
            return None
        try:
            text = render(
                messages=conversation,
                add_generation_prompt=add_generation_prompt,
                **self._specials,
            )
        except jinja2.exceptions.TemplateError:
            return None  # the template refused it (raise_exception): so will the engine
        return self.encode_chat(text)

    def completion_ids(self, prompt: Any) -> Prompt | None:
        """The prompt ids of a completion: one string, or one list of token ids."""
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            return self.encode(prompt, add_special_tokens=True)
        if isinstance(prompt, list) and prompt and all(_is_id(t) for t in prompt):
            return Prompt(prompt, True)
        return None


class _Segments:
    """Chat prompts tokenized piece by piece, each piece's ids remembered.

    A tokenizer cuts its input at its added tokens (``<|eot_id|>``, ``<|start_header_id|>``...)
    before anything else and encodes the text between them independently, so a rendered chat
    prompt's ids are the concatenation of its pieces' ids. The pieces repeat across requests —
    a system prompt, every earlier turn of a conversation — so each piece of at least
    :data:`SEGMENT_MIN_CHARS` is tokenized once and kept in an LRU bounded to
    :data:`SEGMENT_CACHE_TOKENS` ids: a new turn costs its own tokens, not the conversation's.
    Only for tokenizers where the cut is exact (:meth:`exact_for`).
    """

    def __init__(self, tok: Tokenizer, spec: dict[str, Any]) -> None:
        self._tok = tok
        added = {t["content"]: t["id"] for t in spec.get("added_tokens") or ()}
        # Longest first: at one position the longest added token wins, as in tokenizers.
        alternatives = sorted(added, key=len, reverse=True)
        self._split = re.compile("(" + "|".join(map(re.escape, alternatives)) + ")").split
        self._added = added
        self._cache: OrderedDict[str, array[int]] = OrderedDict()
        self._tokens = 0

    @staticmethod
    def exact_for(spec: dict[str, Any]) -> bool:
        """Whether cutting at added tokens gives the whole text's ids: no normalizer (added
        tokens are matched on raw text), no added token that strips or matches whole words
        (it would take text from its neighbours), no ``Metaspace`` (which prepends to the
        first piece only)."""
        added = spec.get("added_tokens") or ()
        return (
            bool(added)
            and spec.get("normalizer") is None
            and "Metaspace" not in json.dumps(spec.get("pre_tokenizer"))
            and not any(t.get("lstrip") or t.get("rstrip") or t.get("single_word") for t in added)
        )

    def clear(self) -> None:
        self._cache.clear()
        self._tokens = 0

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        added = self._added
        cache = self._cache
        for piece in self._split(text):
            if not piece:
                continue
            tid = added.get(piece)
            if tid is not None:
                ids.append(tid)
                continue
            cached = cache.get(piece)
            if cached is not None:
                cache.move_to_end(piece)
                ids.extend(cached)
                continue
            piece_ids = self._tok.encode_batch([piece], add_special_tokens=False)[0].ids
            ids.extend(piece_ids)
            if len(piece) >= SEGMENT_MIN_CHARS:
                cache[piece] = array("I", piece_ids)
                self._tokens += len(piece_ids)
                while self._tokens > SEGMENT_CACHE_TOKENS:
                    self._tokens -= len(cache.popitem(last=False)[1])
        return ids


def _is_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _message_text(content: Any) -> str | None:
    """A message's content as vLLM gives the template a "string" format: text parts joined by
    newlines; None for other parts (images, audio: placeholders the edge cannot compute)."""
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if not isinstance(content, list):
        return None
    texts: list[str] = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") != "text":
            return None
        text = part.get("text")
        if not isinstance(text, str):
            return None
        texts.append(text)
    return "\n".join(texts)


def load_tokenizers(paths: dict[str, Path], max_chars: int) -> dict[str, ModelTokenizer]:
    """Every configured model's tokenizer; :class:`TokenizerError` names a bad one (at boot)."""
    if max_chars <= CUT_MARGIN_CHARS:
        raise TokenizerError(f"--tokenize-max-chars must exceed {CUT_MARGIN_CHARS}")
    return {model: ModelTokenizer(path, max_chars) for model, path in paths.items()}


def prompt_ids(tok: ModelTokenizer, doc: dict[str, Any], kind: str) -> Prompt | None:
    """The request's prompt ids by endpoint kind (``chat``/``completions``), None if not
    exact (the Responses API is not rendered here)."""
    if kind == "chat":
        return tok.chat_ids(doc)
    if kind == "completions":
        return tok.completion_ids(doc.get("prompt"))
    return None
