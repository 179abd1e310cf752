"""Continuing an answer on the simulator as on vLLM 0.32: a chat request whose final assistant
message is left open (``continue_final_message: true, add_generation_prompt: false``), and a
completion whose prompt is the original prompt plus the text already relayed. Driven in-process
through ASGI, as ``test_sim_server``."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer as RawTokenizer

from bench.harness.tokenizer import build
from regions.engines.prompt_tokens import ModelTokenizer
from regions.engines.simulator.engine import EngineConfig, SimEngine
from regions.engines.simulator.server import EngineApp
from regions.engines.simulator.tokenizer import (
    CONTINUE_WITH_GENERATION_PROMPT,
    FINAL_MESSAGE_NOT_RENDERED,
    Tokenizer,
    open_final_message,
)
from tests.unit.test_sim_server import CHAT, call, with_engine

MODEL = "tiny-llama"
TURNS = [
    {"role": "system", "content": "You answer questions about invoices and refunds. " * 3},
    {"role": "user", "content": "Why was I charged twice in March?"},
]
#: vLLM 0.32's answer to both flags set: ``ChatCompletionRequest.check_generation_prompt`` (a
#: ``mode="before"`` model validator raising ``VLLMValidationError``) through FastAPI and vLLM's
#: ``validation_exception_handler``.
BOTH_FLAGS = (
    "1 validation error:\n  {'type': 'value_error', 'loc': 'body', 'msg': 'Value error, Cannot "
    "set both `continue_final_message` and `add_generation_prompt` to True.', 'input': "
    "'<dict of 4 items>', 'ctx': {'error': VLLMValidationError('Cannot set both "
    "`continue_final_message` and `add_generation_prompt` to True.')}}"
)


def continuation(relayed: str, **fields: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [*TURNS, {"role": "assistant", "content": relayed}],
        "add_generation_prompt": False,
        "continue_final_message": True,
        **fields,
    }


def test_both_flags_true_is_vllms_validation_error() -> None:
    async def check(app: EngineApp, engine: SimEngine) -> None:
        body = continuation("The charge", add_generation_prompt=True)
        r = await call(app, "POST", CHAT, body)
        assert r.status == 400
        assert r.json() == {
            "error": {"message": BOTH_FLAGS, "type": "Bad Request", "param": "body", "code": 400}
        }
        # A model validator that runs before the fields are checked: even without messages.
        r = await call(
            app, "POST", CHAT, {"continue_final_message": True, "add_generation_prompt": True}
        )
        assert r.status == 400 and "<dict of 2 items>" in r.json()["error"]["message"]
        # continue_final_message alone passes the validator (add_generation_prompt is not in
        # the body), then the template refuses both: transformers' text, vLLM's BadRequestError.
        alone = continuation("The charge")
        del alone["add_generation_prompt"]
        r = await call(app, "POST", CHAT, alone)
        assert r.status == 400
        assert r.json()["error"] == {
            "message": CONTINUE_WITH_GENERATION_PROMPT,
            "type": "BadRequestError",
            "param": None,
            "code": 400,
        }
        r = await call(app, "POST", CHAT, continuation("The charge", continue_final_message=1))
        assert r.status == 400 and r.json()["error"]["param"] == "body.continue_final_message"

    with_engine(check)


def test_continuation_leaves_the_final_message_open_streams_and_counts_it() -> None:
    async def check(app: EngineApp, engine: SimEngine) -> None:
        streamed = {
            "stream": True,
            "stream_options": {"include_usage": True},
            "ignore_eos": True,
        }
        first = await call(
            app, "POST", CHAT, {"model": MODEL, "messages": TURNS, "max_tokens": 8, **streamed}
        )
        events = first.events()
        # The opening chunk carries the role and no text, then one token per chunk.
        deltas = [e["choices"][0]["delta"]["content"] for e in events[1:-2]]
        prompt = events[-2]["usage"]["prompt_tokens"]
        # The engine died after five tokens: the edge re-sends them as the open final message.
        relayed = "".join(deltas[:5])
        assert len(engine.tokenizer.encode(relayed)) == 5  # a text whose tokens are stable

        second = await call(app, "POST", CHAT, continuation(relayed, max_tokens=6, **streamed))
        assert second.status == 200
        events = second.events()
        assert events[-1] == "[DONE]"
        assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        texts = [e["choices"][0]["delta"]["content"] for e in events[1:-2]]
        assert len(texts) == 6 and all(texts)
        assert events[-3]["choices"][0]["finish_reason"] == "length"
        usage = events[-2]["usage"]
        # On vLLM too: the continuation's prompt is the original prompt and the relayed tokens,
        # so it reuses the original request's cached blocks.
        assert usage["prompt_tokens"] == prompt + 5
        assert usage["completion_tokens"] == 6
        assert usage["prompt_tokens_details"]["cached_tokens"] >= prompt // 16 * 16 > 0

        whole = await call(app, "POST", CHAT, continuation(relayed, max_tokens=6, ignore_eos=True))
        doc = whole.json()
        assert doc["usage"]["prompt_tokens"] == prompt + 5
        assert doc["choices"][0]["message"]["content"] == "".join(texts)  # same prompt, answer

    with_engine(check)


def test_the_open_rendering_is_the_generation_prompt_plus_the_text() -> None:
    tok = Tokenizer()
    relayed = "The charge was made twice. It will be"
    normal = tok.apply_chat_template(TURNS)
    opened = tok.apply_chat_template(
        [*TURNS, {"role": "assistant", "content": relayed}], False, continue_final_message=True
    )
    assert opened == normal + relayed and not opened.endswith("<|eot_id|>")
    assert tok.encode(opened) == tok.encode(normal) + tok.encode(relayed)
    with pytest.raises(ValueError, match="not compatible"):
        tok.apply_chat_template(TURNS, True, continue_final_message=True)


@pytest.mark.parametrize(
    ("rendered", "final", "expected"),
    [
        # The template kept the text as it is, trailing whitespace included: kept.
        ("<h>\n\nIt will be \n<e>", "It will be \n", "<h>\n\nIt will be \n"),
        # Leading whitespace: cut right after the stripped text.
        ("<h>\n\n It will be \n<e>", " It will be \n", "<h>\n\n It will be"),
        # A template that trims the content (Llama 3's ``| trim``): the stripped text.
        ("<h>\n\nIt will be<e>", "It will be \n", "<h>\n\nIt will be"),
        # The last occurrence, as transformers' ``rindex``.
        ("<h>be<u>be<a>be<e>", "be", "<h>be<u>be<a>be"),
    ],
)
def test_open_final_message_cuts_as_transformers(rendered: str, final: str, expected: str) -> None:
    assert open_final_message(rendered, [{"role": "assistant", "content": final}]) == expected


def test_a_final_message_the_template_dropped_is_refused() -> None:
    with pytest.raises(ValueError) as err:
        open_final_message("<h>\n\n<e>", [{"role": "assistant", "content": "gone"}])
    assert str(err.value) == FINAL_MESSAGE_NOT_RENDERED


def test_completion_continuation_is_the_prompt_plus_the_relayed_text() -> None:
    async def check(app: EngineApp, engine: SimEngine) -> None:
        prompt = "Why was I charged twice in March?"
        relayed = " The charge was made twice."
        body = {"model": MODEL, "max_tokens": 4, "ignore_eos": True}
        first = (await call(app, "POST", "/v1/completions", {**body, "prompt": prompt})).json()
        again = await call(app, "POST", "/v1/completions", {**body, "prompt": prompt + relayed})
        relayed_tokens = len(engine.tokenizer.encode(relayed))
        assert again.json()["usage"]["prompt_tokens"] == (
            first["usage"]["prompt_tokens"] + relayed_tokens
        )

    with_engine(check)


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build(tmp_path_factory.mktemp("bench-tokenizer"))


def test_with_a_model_tokenizer_the_template_is_left_open(tok_dir: Path) -> None:
    raw = RawTokenizer.from_file(str(tok_dir / "tokenizer.json"))
    relayed = "The charge was made twice. It will be"
    config = EngineConfig(
        model="var/tiny-llama",
        served_model_names=(MODEL,),
        accelerator="B200",
        num_gpu_blocks=4096,
        max_model_len=1024,
        zero_latency=True,
    )
    # The bench template (Llama 3's), rendered without generation prompt and left open.
    rendered = "<|begin_of_text|>" + "".join(
        f"<|start_header_id|>{m['role']}<|end_header_id|>\n\n{m['content']}<|eot_id|>"
        for m in TURNS
    )
    rendered += f"<|start_header_id|>assistant<|end_header_id|>\n\n{relayed}"
    expected = len(raw.encode(rendered, add_special_tokens=False).ids)

    async def main() -> None:
        engine = SimEngine(config, prompt_tokenizer=ModelTokenizer(tok_dir))
        loop_task = asyncio.ensure_future(engine.run())
        try:
            app = EngineApp(engine)
            r = await call(app, "POST", CHAT, continuation(relayed, max_tokens=3))
            assert r.status == 200 and r.json()["usage"]["prompt_tokens"] == expected
            alone = continuation(relayed)
            del alone["add_generation_prompt"]
            r = await call(app, "POST", CHAT, alone)
            assert r.status == 400 and r.json()["error"]["type"] == "BadRequestError"
        finally:
            engine.close()
            await asyncio.wait_for(loop_task, 5)

    asyncio.run(main())
