"""Exact cached prefixes from tokens and KV events (regions/edge/view/token_prefix.py): the prompt's
vLLM block hashes looked up in what an engine's events say it holds."""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path

import msgspec
import pytest
from prometheus_client import CollectorRegistry

from bench.harness.tokenizer import build
from regions.edge.policy.prefix_index import PrefixIndex
from regions.edge.policy.scheduler import Candidate, RouteRequest, SchedulerConfig, score
from regions.edge.view.kv_events import EngineCache, KvEventHub, KvEventSubscriber
from regions.edge.view.token_prefix import CHARS_PER_ID, RECENT_S, TokenPrefixes, token_id_head
from regions.engines.block_hash import DEFAULT_SEED, block_hashes, none_hash
from regions.engines.prompt_tokens import ModelTokenizer
from regions.engines.simulator.kv_events import BlockStored, KVEventBatch
from regions.tables.schema import Instance

MODEL = "bench"
A = Instance(id="a", url="http://a", model=MODEL, kv_block_tokens=16)
B = Instance(id="b", url="http://b", model=MODEL, kv_block_tokens=16)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> ModelTokenizer:
    return ModelTokenizer(build(tmp_path_factory.mktemp("bench-tokenizer")))


def hub_with(*instances: Instance) -> KvEventHub:
    hub = KvEventHub(PrefixIndex(), 16.0, CollectorRegistry())
    hub.sync(instances)
    for inst in instances:
        hub.caches[inst.id] = EngineCache(known=True, next_seq=1)
    return hub


def stored(cache: EngineCache, hashes: list[int], seq: int = 1, size: int = 16) -> None:
    """The engine's event, through the subscriber's decoder (as it arrives on the wire)."""
    payload = msgspec.msgpack.encode(
        KVEventBatch(
            ts=1.0,
            events=[BlockStored(hashes, None, [], size, None, "GPU", None)],
            data_parallel_rank=0,
        )
    )
    sub = KvEventSubscriber(
        "x",
        "tcp://x",
        PrefixIndex(),
        16.0,
        KvEventHub(PrefixIndex(), 16.0, CollectorRegistry()).metrics,
    )
    sub.cache = cache
    sub.receive([b"kv-events", seq.to_bytes(8, "big"), payload])


def chat(system: str, user: str) -> dict[str, object]:
    return {"messages": [{"role": "system", "content": system}, {"role": "user", "content": user}]}


SYSTEM = " ".join(["the edge routes each request to the engine that holds its prefix"] * 12)


def test_an_instance_holds_the_longest_run_of_the_prompts_blocks_its_events_report(
    tokenizer: ModelTokenizer,
) -> None:
    hub = hub_with(A, B)
    exact = TokenPrefixes({MODEL: tokenizer}, hub, DEFAULT_SEED)
    first = exact.prompt(MODEL, "chat", chat(SYSTEM, "one"), None, {16})
    second = exact.prompt(MODEL, "chat", chat(SYSTEM, "two, another question"), None, {16})
    assert first is not None and second is not None
    hashes = first.hashes(16)
    # what vLLM computes for these tokens (block_hash.py is checked against vLLM itself)
    assert hashes == block_hashes(first.ids, 16, none_hash(), max_blocks=(len(first.ids) - 1) // 16)
    stored(hub.caches["a"], hashes)
    shared = next(
        i for i, (x, y) in enumerate(zip(hashes, second.hashes(16), strict=False)) if x != y
    )
    assert shared >= 4  # the system prompt spans several blocks
    now = time.monotonic()
    assert exact.cached_tokens(second, A, now, {}) == shared * 16
    assert exact.cached_tokens(second, B, now, {}) == 0
    # a gap (or a late join) makes the set unknown: the estimate decides, not a stale set
    hub.caches["a"].known = False
    assert exact.cached_tokens(second, A, now, {}) is None


def test_the_last_prompt_token_is_never_cached_and_the_salt_keys_the_chain(
    tokenizer: ModelTokenizer,
) -> None:
    hub = hub_with(A)
    exact = TokenPrefixes({MODEL: tokenizer}, hub, DEFAULT_SEED)
    ids = list(range(300, 332))  # exactly two blocks
    tokens = exact.prompt(MODEL, "completions", {"prompt": ids}, None, {16})
    assert tokens is not None
    stored(hub.caches["a"], block_hashes(ids, 16, none_hash()))  # both blocks held
    assert exact.cached_tokens(tokens, A, time.monotonic(), {}) == 16  # vLLM computes token 32
    salted = exact.prompt(MODEL, "completions", {"prompt": ids}, "t:x", {16})
    assert salted is not None and exact.cached_tokens(salted, A, time.monotonic(), {}) == 0


def test_this_edges_own_routing_counts_until_the_engine_could_have_reported_it(
    tokenizer: ModelTokenizer,
) -> None:
    hub = hub_with(A, B)
    exact = TokenPrefixes({MODEL: tokenizer}, hub, DEFAULT_SEED)
    tokens = exact.prompt(MODEL, "chat", chat(SYSTEM, "one"), None, {16})
    assert tokens is not None
    exact.sent(tokens, B)
    full = len(tokens.hashes(16)) * 16
    now = time.monotonic()
    assert exact.cached_tokens(tokens, B, now, {}) == full
    assert exact.cached_tokens(tokens, B, now + RECENT_S + 0.1, {}) == 0  # only events now


def test_a_model_without_tokenizer_or_an_adapter_is_left_to_the_estimate(
    tokenizer: ModelTokenizer,
) -> None:
    exact = TokenPrefixes({MODEL: tokenizer}, hub_with(A), DEFAULT_SEED)
    assert exact.wants(MODEL, "chat") and exact.wants(MODEL, "completions")
    assert not exact.wants("other", "chat") and not exact.wants(MODEL, "responses")
    assert exact.block_sizes([A, msgspec.structs.replace(A, id="unfollowed")]) == {16}


def test_the_scheduler_takes_exact_cached_tokens_over_the_estimate() -> None:
    base = Candidate(
        id="a", model=MODEL, adapters=(), role="mixed", state="ready", healthy=True,
        max_concurrency=8, prefill_tokens_per_s=1000.0, inflight=0, outstanding=0, waiting=0,
        kv_usage=0.0, pending_tokens=0.0, mean_uncached_tokens=0.0, mean_service_s=1.0,
        cached_blocks=10,
    )  # fmt: skip
    req = RouteRequest(model=MODEL, prompt_tokens=500, block_tokens=16.0)
    cfg = SchedulerConfig()
    estimated = score(base, req, cfg)
    assert estimated.cached_tokens == 160 and not estimated.exact
    exact = score(replace(base, cached_tokens=384), req, cfg)
    assert exact.cached_tokens == 384 and exact.exact
    assert exact.ttft_s < estimated.ttft_s
    assert score(replace(base, cached_tokens=0), req, cfg).cached_tokens == 0


def test_a_template_that_fails_on_a_request_leaves_it_to_the_estimate_and_is_counted(
    tmp_path: Path,
) -> None:
    directory = build(tmp_path)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config["chat_template"] = "{{ messages[0]['content'] + 1 }}"  # str + int: a TypeError
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    registry = CollectorRegistry()
    exact = TokenPrefixes({MODEL: ModelTokenizer(directory)}, hub_with(A), DEFAULT_SEED, registry)
    assert exact.prompt(MODEL, "chat", chat("s", "u"), None, {16}) is None
    assert registry.get_sample_value("fedinfer_edge_tokenize_failures_total", {"model": MODEL}) == 1
    # completions do not use the template
    assert exact.prompt(MODEL, "completions", {"prompt": "the edge"}, None, {16}) is not None


def test_a_busy_tokenizer_thread_leaves_requests_to_the_estimate_instead_of_a_line(
    tokenizer: ModelTokenizer,
) -> None:
    import asyncio
    from types import SimpleNamespace

    from regions.edge.http.endpoints import CHAT
    from regions.edge.http.parse import ParsedRequest
    from regions.edge.stages.place import Placement
    from regions.edge.view.token_prefix import MAX_PENDING

    registry = CollectorRegistry()
    exact = TokenPrefixes({MODEL: tokenizer}, hub_with(A), DEFAULT_SEED, registry)
    placement = Placement.__new__(Placement)
    placement.tokens = exact
    placement.fleet = SimpleNamespace(by_model={MODEL: (A,)})  # type: ignore[assignment]
    doc = chat(SYSTEM, "one")
    req = ParsedRequest(CHAT, MODEL, b"", 10, False, b"", False, None, doc=doc)

    async def tokenize() -> object:
        ctx = SimpleNamespace(req=req, tokens=None)
        await placement.tokenize(ctx)  # type: ignore[arg-type]
        return ctx.tokens

    assert asyncio.run(tokenize()) is not None and exact.pending == 0
    assert req.prompt_tokens > 100  # the exact count replaced the estimate
    exact.pending = MAX_PENDING  # the thread is that far behind
    assert asyncio.run(tokenize()) is None
    assert registry.get_sample_value("fedinfer_edge_tokenize_skipped_total", {"model": MODEL}) == 1
    exact.close()


def test_a_token_id_prompt_is_cut_where_the_text_cut_would_leave_a_text_prompt(
    tmp_path: Path,
) -> None:
    """ids come tokenized: they are cut to ``max_chars // CHARS_PER_ID`` (the text path's cut
    in tokens) before being checked and hashed, and placement is told the count is not whole;
    a shorter id prompt is used whole."""
    tok = ModelTokenizer(build(tmp_path), max_chars=4000)
    cap = 4000 // CHARS_PER_ID
    exact = TokenPrefixes({MODEL: tok}, hub_with(A), DEFAULT_SEED)
    long_ids = [(7 * i) % 1000 + 1 for i in range(1_000_000)]  # a 4 MiB body's worth
    cut = exact.prompt(MODEL, "completions", {"prompt": long_ids}, None, {16})
    assert cut is not None and not cut.complete
    assert list(cut.ids) == long_ids[:cap]
    assert cut.hashes(16) == block_hashes(
        long_ids[:cap], 16, none_hash(), max_blocks=(cap - 1) // 16
    )
    whole = exact.prompt(MODEL, "completions", {"prompt": long_ids[:cap]}, None, {16})
    assert whole is not None and whole.complete and len(whole.ids) == cap
    assert token_id_head("completions", {"prompt": "x" * 10_000}, cap) is None  # text: its own cut
    assert token_id_head("chat", {"prompt": long_ids}, cap) is None
