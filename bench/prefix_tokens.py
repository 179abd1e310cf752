"""What exact prefix knowledge costs the edge per request (``python -m bench.prefix_tokens``).

For chat prompts of about ``--tokens`` tokens (a long system prompt and a short user turn), the
stages the edge runs per request, each timed over ``--repeat`` runs (median, µs):

* render + tokenize: the chat template and the ``tokenizers`` encoding
  (``regions/engines/prompt_tokens.py``; in the edge's worker thread), cold, and with the
  system prompt seen before (its ids from the segment cache, a new user turn each time);
* hash: vLLM's ``sha256_cbor`` block hashes at block sizes 16 (GPU) and 128 (vLLM's CPU
  backend) (``regions/engines/block_hash.py``; same thread), and at 16 for a prompt whose
  blocks were hashed before (``BlockMemo``);
* lookup: the longest held run on ``--instances`` engines' reported block sets, one holding
  the whole prompt (``EngineCache.depth``; on the event loop);
* the byte estimate's hashing for comparison (``prefix_index.block_hashes``).

Tokenizers: the simulator's bench tokenizer (built), and ``var/tiny-llama``'s when it exists
(``make vllm-env``). Results as a Markdown table and JSON under ``var/bench/``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from bench.harness.tokenizer import build
from regions.edge.policy.prefix_index import block_hashes as byte_hashes
from regions.edge.view.kv_events import EngineCache
from regions.engines.block_hash import BlockMemo, block_hashes, none_hash
from regions.engines.prompt_tokens import ModelTokenizer

ROOT = Path(__file__).resolve().parents[1]
TEXT = (
    "route the request to the engine that holds the prefix of its prompt in cache and keep "
    "the session there unless the queue grows longer than a cold prefill elsewhere"
)
WORDS = TEXT.split(" ")


def _median_us(fn: Callable[[], object], repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def _chat(tok: ModelTokenizer, tokens: int) -> dict[str, object]:
    """A chat request of about ``tokens`` tokens under ``tok``."""
    words = 8
    while True:
        system = " ".join(
            WORDS[i % len(WORDS)] + (f" {i}" if i % 17 == 0 else "") for i in range(words)
        )
        doc = {
            "messages": [
                {"role": "system", "content": system},
                {"role": "user", "content": "What does the edge do with a long prompt?"},
            ]
        }
        prompt = tok.chat_ids(doc)
        assert prompt is not None
        if len(prompt.ids) >= tokens:
            return doc
        words = int(words * max(1.05, tokens / len(prompt.ids)))


def measure(name: str, tok: ModelTokenizer, tokens: int, instances: int, repeat: int) -> dict:
    """Each stage's median time for one tokenizer: where a request's microseconds go."""
    doc = _chat(tok, tokens)
    prompt = tok.chat_ids(doc)
    assert prompt is not None
    ids = prompt.ids
    root = none_hash()
    rendered = json.dumps(doc).encode()
    row: dict[str, object] = {"tokenizer": name, "prompt_tokens": len(ids)}
    segments = tok._segments

    def cold() -> object:
        if segments is not None:
            segments.clear()
        return tok.chat_ids(doc)

    messages = doc["messages"]
    assert isinstance(messages, list)
    turns = iter(range(10**9))

    def warm() -> object:  # the same system prompt, a new user turn each time
        user = {"role": "user", "content": f"Question {next(turns)}: what does the edge do?"}
        return tok.chat_ids({"messages": [messages[0], user]})

    row["render_tokenize_us"] = _median_us(cold, repeat)
    row["tokenize_seen_system_us"] = _median_us(warm, repeat)
    for size in (16, 128):
        row[f"hash_bs{size}_us"] = _median_us(lambda s=size: block_hashes(ids, s, root), repeat)
    memo = BlockMemo()
    row["hash_bs16_seen_us"] = _median_us(lambda: block_hashes(ids, 16, root, memo=memo), repeat)
    hashes = block_hashes(ids, 16, root)
    caches = [EngineCache(known=True) for _ in range(instances)]
    caches[0].blocks = dict.fromkeys(hashes, 16)  # one engine holds it all
    for cache in caches[1:]:
        cache.blocks = dict.fromkeys(range(len(hashes)), 16)  # the others, other blocks
    row["lookup_us"] = _median_us(lambda: [c.depth(hashes) for c in caches], repeat)
    row["byte_estimate_hash_us"] = _median_us(lambda: byte_hashes(rendered, 1), repeat)
    return row


def main(argv: list[str]) -> None:
    """Measure both tokenizers; print the table and write the JSON under var/bench/."""
    p = argparse.ArgumentParser(prog="python -m bench.prefix_tokens", description=__doc__)
    p.add_argument("--tokens", type=int, default=2000, help="prompt size (default 2000)")
    p.add_argument("--instances", type=int, default=8, help="engines looked up (default 8)")
    p.add_argument("--repeat", type=int, default=200)
    opts = p.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tokenizers = {"bench (sim)": ModelTokenizer(build(Path(tmp)))}
        tiny = ROOT / "var" / "tiny-llama"
        if (tiny / "tokenizer.json").is_file():
            tokenizers["tiny-llama"] = ModelTokenizer(tiny)
        for name, tok in tokenizers.items():
            rows.append(measure(name, tok, opts.tokens, opts.instances, opts.repeat))
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    cols = list(rows[0])
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for row in rows:
        print(
            "| "
            + " | ".join(f"{v:.0f}" if isinstance(v, float) else str(v) for v in row.values())
            + " |"
        )
    out = ROOT / "var" / "bench" / "prefix_tokens.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"load": os.getloadavg()[0], "rows": rows}, indent=2))


if __name__ == "__main__":
    main(sys.argv[1:])
