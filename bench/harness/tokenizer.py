"""A small real tokenizer for the simulator's bench model, generated deterministically.

Bench-only: the routing and prefix-tokens benchmarks and the exact-prefix tests build it; the
product never does. The simulator's built-in tokenizer
(``regions/engines/simulator/tokenizer.py``) is a stand-in no router can reproduce. With
``fedinfer engine-sim --tokenizer DIR --prefix-caching-hash-algo sha256_cbor`` the engines
tokenize prompts with the files written here and hash blocks as vLLM does, and an edge given
the same directory (``fedinfer edge --tokenizer MODEL=DIR``) predicts their cache exactly.

The files are what a model ships: ``tokenizer.json`` (a byte-level BPE of 4 096 ids trained by
the ``tokenizers`` library on text made of the simulator's own words, so its prompts come to
about four characters a token) and ``tokenizer_config.json`` with Llama 3's chat template and
special tokens (the built-in tokenizer's rendering); a completion's prompt gets the BOS token,
as Llama 3's ``tokenizer.json`` adds it. Same library version, same files: the
corpus and the trainer are deterministic.

    python -m bench.harness.tokenizer var/bench-tokenizer
"""

from __future__ import annotations

import json
import random
import sys
from collections.abc import Iterator
from pathlib import Path

from regions.engines.simulator.tokenizer import _WORDS, SPECIAL_TOKENS

SEED = 20261201
VOCAB_SIZE = 4096
#: Llama 3's template, as the built-in tokenizer renders it.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{{ message['content'] + '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{% endif %}"
)


def _corpus(rng: random.Random, lines: int = 4000) -> Iterator[str]:
    words = list(_WORDS)
    for _ in range(lines):
        sentence = " ".join(rng.choice(words) for _ in range(rng.randint(4, 20)))
        number = f" {rng.randint(0, 999)}" if rng.random() < 0.2 else ""
        yield sentence.capitalize() + number + rng.choice([".", "?", "!", ",", ":"])


def build(out: Path) -> Path:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` into ``out``; returns ``out``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    specials = list(SPECIAL_TOKENS)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(random.Random(SEED)), trainer=trainer)
    # As Llama 3's: encoding with special tokens (a completion's prompt) adds the BOS; a chat
    # prompt's BOS is the template's.
    bos = "<|begin_of_text|>"
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A $B", special_tokens=[(bos, tok.token_to_id(bos))]
    )
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    config = {
        "bos_token": "<|begin_of_text|>",
        "eos_token": "<|eot_id|>",
        "chat_template": CHAT_TEMPLATE,
        "model_max_length": 131072,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python -m bench.harness.tokenizer OUTDIR")
    print(build(Path(sys.argv[1])))
