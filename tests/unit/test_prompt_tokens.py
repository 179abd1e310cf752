"""A model's tokenizer and chat template as vLLM applies them (regions/engines/prompt_tokens.py),
on the simulator's bench tokenizer (a real byte-level BPE tokenizer.json, built here)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from bench.harness.tokenizer import build
from regions.engines.prompt_tokens import (
    CUT_MARGIN_CHARS,
    ModelTokenizer,
    TokenizerError,
    prompt_ids,
)


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build(tmp_path_factory.mktemp("bench-tokenizer"))


@pytest.fixture(scope="module")
def raw(tok_dir: Path) -> Tokenizer:
    return Tokenizer.from_file(str(tok_dir / "tokenizer.json"))


SYSTEM = "You are the edge of the world, and this is a long line of text for it."
RENDERED = (
    "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
    f"{SYSTEM}<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nfirst\nsecond<|eot_id|>"
    "<|start_header_id|>assistant<|end_header_id|>\n\n"
)


def test_chat_prompts_are_the_template_rendered_and_tokenized_without_added_specials(
    tok_dir: Path, raw: Tokenizer
) -> None:
    tok = ModelTokenizer(tok_dir)
    doc = {
        "messages": [
            {"role": "system", "content": SYSTEM},
            # text parts are joined by newlines, as vLLM gives a "string" template
            {
                "role": "user",
                "content": [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}],
            },
        ]
    }
    prompt = tok.chat_ids(doc)
    assert prompt is not None and prompt.complete
    assert list(prompt.ids) == raw.encode(RENDERED, add_special_tokens=False).ids
    bos = raw.token_to_id("<|begin_of_text|>")
    assert prompt.ids[0] == bos and prompt.ids[1] != bos  # the template's, not added again
    no_gen = tok.chat_ids({**doc, "add_generation_prompt": False})
    assert no_gen is not None and len(no_gen.ids) < len(prompt.ids)
    assert prompt_ids(tok, doc, "chat") == prompt


@pytest.mark.parametrize(
    "change",
    [
        {"tools": [{"type": "function", "function": {"name": "f"}}]},
        {"chat_template_kwargs": {"x": 1}},
        {
            "messages": [
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}
            ]
        },
        {"messages": [{"role": "developer", "content": "be brief"}]},
        {"messages": [{"role": "assistant", "content": "", "tool_calls": []}]},
        {"add_generation_prompt": "yes"},
        {"messages": "hello"},
    ],
)
def test_what_the_edge_cannot_render_exactly_is_not_tokenized(
    tok_dir: Path, change: dict[str, object]
) -> None:
    doc = {"messages": [{"role": "user", "content": "hi"}], **change}
    assert ModelTokenizer(tok_dir).chat_ids(doc) is None


def test_completions_add_special_tokens_and_take_token_ids_as_they_are(
    tok_dir: Path, raw: Tokenizer
) -> None:
    tok = ModelTokenizer(tok_dir)
    text = "the cache of the edge"
    ids = raw.encode(text).ids
    assert ids[0] == raw.token_to_id("<|begin_of_text|>")  # the tokenizer adds the BOS
    assert list(tok.completion_ids(text).ids) == ids  # type: ignore[union-attr]
    assert list(tok.completion_ids([text]).ids) == raw.encode(text).ids  # type: ignore[union-attr]
    assert tok.completion_ids([5, 6, 7]) == (([5, 6, 7]), True)
    assert tok.completion_ids(["a", "b"]) is None  # several prompts: not one prefix
    assert tok.completion_ids([1, True]) is None
    assert prompt_ids(tok, {"prompt": text}, "responses") is None


def test_a_prompt_longer_than_the_bound_is_cut_to_a_stable_head(
    tok_dir: Path, raw: Tokenizer
) -> None:
    words = " ".join(f"word{i % 97} the of" for i in range(2000))
    full = raw.encode(words).ids
    tok = ModelTokenizer(tok_dir, max_chars=4000)
    head = tok.completion_ids(words)
    assert head is not None and not head.complete
    assert 0 < len(head.ids) < len(full)
    assert list(head.ids) == full[: len(head.ids)]  # a prefix of the whole prompt's tokens
    enc = raw.encode(words[:4000])
    assert enc.offsets[len(head.ids) - 1][1] <= 4000 - CUT_MARGIN_CHARS


def test_a_missing_or_broken_tokenizer_fails_loudly(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(TokenizerError):
        ModelTokenizer(tmp_path)
    with pytest.raises(TokenizerError):
        ModelTokenizer(tmp_path / "nothing.json")


def test_chat_prompts_tokenized_piece_by_piece_equal_the_whole(
    tok_dir: Path, raw: Tokenizer
) -> None:
    """The segment cache: pieces between added tokens, each tokenized once, give the ids of
    the whole rendered prompt — whatever the text (spaces and newlines at a cut, an added token
    written by a client inside a message, repeated pieces from the cache)."""
    tok = ModelTokenizer(tok_dir)
    assert tok._segments is not None  # a byte-level BPE without normalizer: exact
    rng = random.Random(7)
    words = ["the", " edge", "\n\n", "  ", "route", "<|eot_id|>", "42", ".", "prefix ", "é"]
    for _ in range(200):
        turns = [
            {
                "role": rng.choice(["system", "user", "assistant"]),
                "content": "".join(rng.choices(words, k=rng.randint(0, 60))),
            }
            for _ in range(rng.randint(1, 4))
        ]
        doc = {"messages": turns, "add_generation_prompt": rng.random() < 0.8}
        prompt = tok.chat_ids(doc)
        assert prompt is not None
        rendered = tok._render(
            messages=turns, add_generation_prompt=doc["add_generation_prompt"], **tok._specials
        )  # type: ignore[misc]
        assert list(prompt.ids) == raw.encode(rendered, add_special_tokens=False).ids


def test_tokenizers_whose_cut_is_not_exact_are_tokenized_whole() -> None:
    from regions.engines.prompt_tokens import _Segments

    added = [{"id": 1, "content": "<s>", "lstrip": False, "rstrip": False, "single_word": False}]
    assert _Segments.exact_for({"added_tokens": added, "normalizer": None, "pre_tokenizer": {}})
    assert not _Segments.exact_for({"added_tokens": added, "normalizer": {"type": "NFC"}})
    metaspace = {"type": "Metaspace", "prepend_scheme": "first"}
    assert not _Segments.exact_for(
        {"added_tokens": added, "normalizer": None, "pre_tokenizer": metaspace}
    )
    stripping = [{**added[0], "rstrip": True}]
    assert not _Segments.exact_for({"added_tokens": stripping, "normalizer": None})
