"""Build a tiny random-weight Llama and a locally trained BPE tokenizer as a Hugging Face dir.

No weights can be downloaded on these machines, yet the real vLLM server needs a model: this
script makes one that is small (about 19 M parameters, 76 MB), deterministic (seeded) and good
enough for the protocol — the text it generates is noise, but tokenisation, the chat template,
the scheduler, the paged KV cache, prefix caching and the metrics are all real.

Not smaller: with ~1 M parameters the engine outran vLLM's API server, whose event loop (which
also answers /metrics) then spent its time turning tokens into text; /metrics took 3 to 6 s and,
served in the gaps, read the loaded server as idle most of the time. At this size the engine is
the bottleneck, as with a real model on a GPU, and /metrics answers in ~50 ms under load.

    .venv-vllm/bin/python tests/vllm/build_tiny_model.py var/tiny-llama

Idempotent: a stamp file records a hash of this script; an up-to-date directory is left alone.
It needs ``torch``, ``transformers`` and ``tokenizers`` (all in ``.venv-vllm``).
"""

from __future__ import annotations

import hashlib
import json
import random
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

SEED = 20261129
VOCAB_SIZE = 2048
HIDDEN = 512
HEADS = 8  # head size 64: the CPU attention backend accepts 32, 64, 80, 96, 112, 128, ...
LAYERS = 4
MAX_POSITIONS = 4096
STAMP = ".fedinfer-tiny-llama"

BOS, EOS, UNK, PAD = "<s>", "</s>", "<unk>", "<pad>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [PAD, BOS, EOS, UNK, IM_START, IM_END]

# ChatML. vLLM renders it with the tokenizer's apply_chat_template; generation stops at
# <|im_end|> (the model's eos_token_id) or at max_tokens.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_SYLLABLES = [
    "ka",
    "to",
    "ri",
    "en",
    "su",
    "ma",
    "no",
    "ha",
    "te",
    "lo",
    "vi",
    "de",
    "ra",
    "mi",
    "ko",
    "an",
    "or",
    "is",
    "un",
    "el",
    "pre",
    "fix",
    "cache",
    "block",
    "route",
    "edge",
    "engine",
    "token",
    "queue",
    "load",
    "model",
    "region",
]
_WORDS = [
    "the",
    "a",
    "of",
    "and",
    "to",
    "in",
    "is",
    "you",
    "that",
    "it",
    "for",
    "on",
    "with",
    "as",
    "are",
    "this",
    "be",
    "at",
    "or",
    "from",
    "system",
    "user",
    "assistant",
    "prompt",
    "answer",
    "question",
    "request",
    "please",
    "explain",
    "route",
    "cache",
    "prefix",
    "block",
    "token",
    "engine",
    "region",
    "edge",
    "latency",
    "throughput",
    "GPU",
    "model",
    "hello",
    "world",
    "fedinfer",
    "vLLM",
    "llama",
    "server",
    "client",
    "stream",
    "usage",
    "metrics",
    "one",
    "two",
    "three",
    "four",
    "five",
    "six",
    "seven",
    "eight",
    "nine",
    "ten",
]


def _script_hash() -> str:
    return hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:16]


def _corpus(rng: random.Random, lines: int = 6000) -> Iterator[str]:
    """Generated text: common English/domain words, invented words, digits and punctuation."""
    invented = [
        "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 3))) for _ in range(800)
    ]
    for _ in range(lines):
        words = []
        for _ in range(rng.randint(4, 24)):
            r = rng.random()
            if r < 0.55:
                words.append(rng.choice(_WORDS))
            elif r < 0.9:
                words.append(rng.choice(invented))
            else:
                words.append(str(rng.randint(0, 9999)))
        sentence = " ".join(words)
        yield sentence[0].upper() + sentence[1:] + rng.choice([".", "?", "!", ",", ":"])


def build_tokenizer(out: Path) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=UNK))
    # Byte-level: any input text tokenises (no <unk> at run time), the decoder restores it.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(random.Random(SEED)), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=IM_END,
        unk_token=UNK,
        pad_token=PAD,
        additional_special_tokens=[EOS, IM_START],
        chat_template=CHAT_TEMPLATE,
        model_max_length=MAX_POSITIONS,
        clean_up_tokenization_spaces=False,
    )
    fast.save_pretrained(str(out))
    # transformers 5 writes the template to chat_template.jinja; older loaders (and people)
    # look for it in tokenizer_config.json, so it goes there too.
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = CHAT_TEMPLATE
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return len(fast)


def build_model(out: Path, vocab_size: int, bos_id: int, eos_id: int, pad_id: int) -> None:
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(SEED)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=HIDDEN,
        intermediate_size=4 * HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS,
        max_position_embeddings=MAX_POSITIONS,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(config).to(torch.float32).eval()
    model.generation_config = GenerationConfig(
        bos_token_id=bos_id, eos_token_id=eos_id, pad_token_id=pad_id
    )
    model.save_pretrained(str(out), safe_serialization=True)


def build(out: Path) -> Path:
    stamp = out / STAMP
    if stamp.is_file() and stamp.read_text().strip() == _script_hash():
        return out
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    vocab_size = build_tokenizer(tmp)

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tmp))
    build_model(
        tmp,
        vocab_size,
        tok.convert_tokens_to_ids(BOS),
        tok.convert_tokens_to_ids(IM_END),
        tok.convert_tokens_to_ids(PAD),
    )
    (tmp / STAMP).write_text(_script_hash() + "\n")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def main(argv: list[str]) -> None:
    if len(argv) != 1:
        raise SystemExit("usage: build_tiny_model.py OUTDIR")
    out = build(Path(argv[0]).resolve())
    print(out)


if __name__ == "__main__":
    main(sys.argv[1:])
