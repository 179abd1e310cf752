"""Capture a real vLLM server's responses, byte for byte, into ``tests/fixtures/vllm/``.

The simulator and the edge test their formats and parsers against these captures. Start one
server as ``docs/real-vllm.md`` says (and, for the pooling routes, a second one with
``--runner pooling``), then (project venv):

    .venv/bin/python tests/vllm/capture_fixtures.py http://127.0.0.1:PORT tests/fixtures/vllm \
        [http://127.0.0.1:POOLING_PORT]

Each body is written exactly as received; ``index.json`` records, per file, the request that
produced it, the status code and the response's content type.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

MODEL = "tiny-llama"
MAX_MODEL_LEN = 1024


def shared_prefix(words: int = 300) -> str:
    """A deterministic system prompt of a few hundred tokens (more than 2 KV blocks of 128)."""
    vocab = [
        "route",
        "the",
        "request",
        "to",
        "the",
        "engine",
        "that",
        "holds",
        "the",
        "prefix",
        "cache",
        "block",
        "of",
        "this",
        "region",
        "and",
        "explain",
        "latency",
        "throughput",
        "tokens",
        "queue",
        "load",
        "model",
        "edge",
    ]
    return " ".join(vocab[(i * 7 + i // 5) % len(vocab)] for i in range(words))


def chat_body(user: str, *, system: str | None = None, **extra: Any) -> dict[str, Any]:
    messages = [{"role": "user", "content": user}]
    if system is not None:
        messages.insert(0, {"role": "system", "content": system})
    return {
        "model": MODEL,
        "messages": messages,
        "max_tokens": 8,
        "temperature": 0,
        "seed": 7,
        **extra,
    }


Recorder = Callable[..., bytes]


def recorder(base_url: str, out: Path, index: dict[str, Any]) -> Recorder:
    """``record(name, method, path, body, want)``: one request's answer into ``out/name``."""

    def record(name: str, method: str, path: str, body: dict[str, Any] | None, want: int) -> bytes:
        with httpx.Client(base_url=base_url, timeout=120.0) as client:
            response = client.request(method, path, json=body)
            raw = response.read()
        if response.status_code != want:
            raise RuntimeError(f"{name}: {method} {path} gave {response.status_code}: {raw!r}")
        (out / name).write_bytes(raw)
        index[name] = {
            "request": {"method": method, "path": path, "json": body},
            "status": response.status_code,
            "content_type": response.headers.get("content-type"),
        }
        return raw

    return record


def capture_routes(
    base_url: str, pooling_url: str | None, out: Path, index: dict[str, Any]
) -> None:
    """The routes beyond completions: Responses (whole, streamed) and the tokenizer's from the
    generating server; embeddings, pooling, score and rerank from a ``--runner pooling`` one."""
    record = recorder(base_url, out, index)
    ask = {"model": MODEL, "input": "Say hello.", "max_output_tokens": 8, "temperature": 0}
    record("responses.json", "POST", "/v1/responses", ask, 200)
    record("responses_stream.txt", "POST", "/v1/responses", {**ask, "stream": True}, 200)
    record("tokenize.json", "POST", "/tokenize", {"model": MODEL, "prompt": "The edge routes"}, 200)
    record("detokenize.json", "POST", "/detokenize", {"model": MODEL, "tokens": [450, 7636]}, 200)
    if pooling_url is None:
        return
    pool = recorder(pooling_url, out, index)
    pool("embeddings.json", "POST", "/v1/embeddings", {"model": MODEL, "input": ["a", "b c"]}, 200)
    pool("pooling.json", "POST", "/pooling", {"model": MODEL, "input": "a"}, 200)
    pool("score.json", "POST", "/score", {"model": MODEL, "text_1": "q", "text_2": ["a", "b"]}, 200)
    pool("rerank.json", "POST", "/rerank", {"model": MODEL, "query": "q", "documents": ["a"]}, 200)


def capture(base_url: str, out: Path, pooling_url: str | None = None) -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    index: dict[str, Any] = {}
    record = recorder(base_url, out, index)
    record("health.txt", "GET", "/health", None, 200)
    record("models.json", "GET", "/v1/models", None, 200)
    record("chat.json", "POST", "/v1/chat/completions", chat_body("Say hello."), 200)
    record(
        "completion.json",
        "POST",
        "/v1/completions",
        {"model": MODEL, "prompt": "The edge routes", "max_tokens": 8, "temperature": 0, "seed": 7},
        200,
    )
    record(
        "chat_stream.txt",
        "POST",
        "/v1/chat/completions",
        chat_body("Stream a few tokens.", stream=True, stream_options={"include_usage": True}),
        200,
    )
    record(
        "completion_stream.txt",
        "POST",
        "/v1/completions",
        {
            "model": MODEL,
            "prompt": "The edge routes",
            "max_tokens": 8,
            "temperature": 0,
            "seed": 7,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
        200,
    )
    record(
        "error_unknown_model.json",
        "POST",
        "/v1/chat/completions",
        {**chat_body("Hello?"), "model": "no-such-model"},
        404,
    )
    # More prompt tokens than --max-model-len (a prompt that fits but leaves too little room
    # for max_tokens is not an error in vLLM 0.32: max_tokens is clamped instead).
    record(
        "error_context_overflow.json",
        "POST",
        "/v1/chat/completions",
        chat_body("route " * (MAX_MODEL_LEN + 100)),
        400,
    )
    # So many characters that vLLM refuses before tokenising (a different message and param).
    record(
        "error_context_overflow_chars.json",
        "POST",
        "/v1/chat/completions",
        chat_body("overflow " * (2 * MAX_MODEL_LEN)),
        400,
    )
    record(
        "error_missing_messages.json",
        "POST",
        "/v1/chat/completions",
        {"model": MODEL},
        400,
    )
    # A repeated long prefix: the second request finds its first blocks in the prefix cache.
    system = shared_prefix()
    record(
        "chat_prefix_first.json",
        "POST",
        "/v1/chat/completions",
        chat_body("First question.", system=system),
        200,
    )
    cached = record(
        "chat_prefix_cached.json",
        "POST",
        "/v1/chat/completions",
        chat_body("Second question.", system=system),
        200,
    )
    details = json.loads(cached)["usage"]["prompt_tokens_details"]
    if not details or not details["cached_tokens"]:
        raise RuntimeError(f"repeated prefix was not served from the prefix cache: {details}")
    capture_routes(base_url, pooling_url, out, index)
    record("metrics.txt", "GET", "/metrics", None, 200)
    capture_busy_metrics(base_url, out, index)
    (out / "index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return index


def capture_busy_metrics(base_url: str, out: Path, index: dict[str, Any]) -> None:
    """``/metrics`` while requests run: non-zero running/waiting gauges and KV-cache usage."""
    body = chat_body("Keep going.", system=shared_prefix(400), max_tokens=600)
    errors: list[BaseException] = []

    def one_request() -> None:
        try:
            with httpx.Client(base_url=base_url, timeout=300.0) as client:
                client.post("/v1/chat/completions", json=body).raise_for_status()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=one_request) for _ in range(3)]
    for thread in threads:
        thread.start()
    busy: bytes | None = None
    content_type: str | None = None
    with httpx.Client(base_url=base_url, timeout=10.0) as client:
        deadline = time.monotonic() + 120
        while busy is None and time.monotonic() < deadline and any(t.is_alive() for t in threads):
            response = client.get("/metrics").raise_for_status()
            raw, content_type = response.content, response.headers.get("content-type")
            for line in raw.decode().splitlines():
                if line.startswith("vllm:num_requests_running{") and float(line.split()[-1]) >= 2:
                    busy = raw
            time.sleep(0.02)
    for thread in threads:
        thread.join(timeout=300)
    if errors:
        raise RuntimeError(f"busy-metrics requests failed: {errors}")
    if busy is None:
        raise RuntimeError("never saw two requests running at once")
    (out / "metrics_busy.txt").write_bytes(busy)
    index["metrics_busy.txt"] = {
        "request": {"method": "GET", "path": "/metrics", "json": None},
        "status": 200,
        "content_type": content_type,
        "note": "taken while 3 chat requests (max_tokens 600) were in flight",
    }


def main(argv: list[str]) -> None:
    if len(argv) not in (2, 3):
        raise SystemExit("usage: capture_fixtures.py BASE_URL OUTDIR [POOLING_URL]")
    pooling = argv[2].rstrip("/") if len(argv) == 3 else None
    index = capture(argv[0].rstrip("/"), Path(argv[1]), pooling)
    for name, entry in index.items():
        print(f"{entry['status']} {name}")


if __name__ == "__main__":
    main(sys.argv[1:])
