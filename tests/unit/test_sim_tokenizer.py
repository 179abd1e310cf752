"""The stand-in tokenizer: prefix-stable chat rendering, round-tripping output, realistic size."""

from __future__ import annotations

import random

import pytest

from regions.engines.simulator.tokenizer import Tokenizer, plan_output

TOK = Tokenizer()


def test_multi_turn_rendering_extends_the_previous_turns_tokens() -> None:
    turns = [
        {"role": "system", "content": "You are a terse assistant for the billing team."},
        {"role": "user", "content": "What is my balance? Account 4711."},
        {"role": "assistant", "content": "Your balance is 12.50 EUR."},
        {"role": "user", "content": "And last month?"},
    ]
    for k in range(1, len(turns)):
        head = TOK.encode(TOK.apply_chat_template(turns[:k], add_generation_prompt=False))
        full = TOK.encode(TOK.apply_chat_template(turns))
        assert full[: len(head)] == head


def test_generated_text_retokenizes_to_the_same_ids() -> None:
    for seed in range(20):
        ids, texts = plan_output(TOK, random.Random(seed), 57)
        assert len(ids) == len(texts) == 57
        assert TOK.encode("".join(texts)) == ids


def test_english_text_is_about_four_characters_per_token() -> None:
    text = "Routing on prefix-cache locality cuts time to first token by large factors. " * 20
    ratio = len(text) / len(TOK.encode(text))
    assert 3.0 <= ratio <= 5.5


def test_content_parts_and_bad_messages() -> None:
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    assert "a\nb" in TOK.apply_chat_template([{"role": "user", "content": parts}])
    with pytest.raises(ValueError):
        TOK.apply_chat_template([{"content": "no role"}])
    with pytest.raises(ValueError):
        TOK.apply_chat_template([{"role": "user", "content": [{"type": "image_url"}]}])
    with pytest.raises(ValueError):
        TOK.apply_chat_template([{"role": "user", "content": 42}])
