"""A stream survives its engine: killed engines (SIGKILL), a drained instance and a dark region,
through real edges, simulated vLLM engines (one process each) and the usage stream in Redis.

The client gets one well-formed stream — one id, no token repeated or lost, one finish and
usage — and the edge one usage record, billed once (``regions/edge/stages/continuation.py``).
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import redis

from regions.edge.policy.hop import hop_keys, sign_hop
from regions.edge.stages.spill_over import now_ms
from regions.supervisor import Process, file_written, start_process, wait_until
from regions.tables.signing import parse_key_ring
from regions.tables.usage import USAGE_FIELD, USAGE_STREAM, UsageRecord, decode_record
from tests.integration.test_edge_support import EdgeProc, route_of, table_doc
from tests.integration.test_edge_support import start_edge as _start_edge
from tests.integration.usage_stream_support import stream_args

REDIS_URL = os.environ["REDIS_URL"]  # this test worker's own (tests/isolation.py)
MODEL = "meta-llama/Llama-3.1-8B-Instruct"
KEY = "fi_AbCdEf12_" + "s" * 43
HELD_KEY = "fi_HeLdHeLd_" + "h" * 43
HOP_KEYS = "h1=hop-secret"


#: The edges a test started: stopped when it ends, whether it passed or not.
_STARTED: list[EdgeProc] = []


def start_edge(tmp: Path, table: dict[str, Any], *args: str) -> EdgeProc:
    edge = _start_edge(tmp, table, *args)
    _STARTED.append(edge)
    return edge


@pytest.fixture(autouse=True)
def _stop_edges() -> Iterator[None]:
    yield
    while _STARTED:
        _STARTED.pop().proc.stop()


def _tenants(regions: list[str]) -> list[dict[str, Any]]:
    def key_hash(key: str) -> str:
        return hashlib.sha256(key.encode()).hexdigest()

    return [
        {"tenant": "acme", "key_hashes": [key_hash(KEY)], "allowed_regions": regions},
        {"tenant": "held", "key_hashes": [key_hash(HELD_KEY)], "allowed_regions": regions[:1]},
    ]


@dataclass
class Sim:
    name: str
    url: str
    proc: Process

    def kill(self) -> None:
        """SIGKILL: the engine's connections are reset, nothing is flushed."""
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=5)


@contextmanager
def sims(tmp: Path, names: list[str], *args: str) -> Iterator[dict[str, Sim]]:
    """One ``engine-sim`` process per engine, so that killing one kills only it."""
    fedinfer = str(Path(sys.executable).with_name("fedinfer"))
    out: dict[str, Sim] = {}
    try:
        for name in names:
            ready = tmp / f"{name}.ready.json"
            cmd = [fedinfer, "engine-sim", "--count", "1", "--port", "0", "--model", MODEL]
            cmd += ["--seed", "5", "--ready-file", str(ready), *args]
            proc = start_process(name, cmd, log=tmp / f"{name}.log")
            out[name] = Sim(name, "", proc)
        for sim in out.values():
            ready = tmp / f"{sim.name}.ready.json"
            wait_until(functools.partial(file_written, ready), what="ready file", watch=sim.proc)
            sim.url = json.loads(ready.read_text())["engines"][0]["url"]
        yield out
    finally:
        for sim in out.values():
            sim.proc.stop()


def inst(sim: Sim) -> dict[str, Any]:
    return {
        "id": sim.name,
        "url": sim.url,
        "model": MODEL,
        "max_concurrency": 64,
        "prefill_tokens_per_s": 15000,
    }


def metered_edge(tmp: Path, region: str, instances: list[Sim], *args: str) -> EdgeProc:
    doc = table_doc(region, 1, [inst(s) for s in instances])
    doc["tenants"] = _tenants([region])
    (tmp / region).mkdir(exist_ok=True)
    return start_edge(
        tmp / region,
        doc,
        *stream_args(tmp / region, f"edge-{region}"),
        "--usage-spool-dir",
        str(tmp / region / "spool"),
        "--usage-redis-url",
        REDIS_URL,
        "--eject-after",
        "1",
        *args,
    )


@pytest.fixture
def usage() -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(REDIS_URL)
    client.delete(USAGE_STREAM)
    yield client
    client.delete(USAGE_STREAM)


def records(client: redis.Redis, n: int) -> list[UsageRecord]:
    def stored() -> list[UsageRecord]:
        entries = client.xrange(USAGE_STREAM)
        return [decode_record(r) for _, f in entries for r in f[USAGE_FIELD].splitlines()]

    wait_until(lambda: len(stored()) >= n, what=f"{n} usage records", timeout=30)
    time.sleep(0.3)  # none more is coming: a second record of one request would be here by now
    return stored()


@dataclass
class Streamed:
    """One client's stream as it arrived: its JSON events, comments, and when each line came
    (``marks``: arrival time and whether it was an event or the continuation's comment)."""

    instance: str = ""
    events: list[dict[str, Any]] = field(default_factory=list)
    comments: list[str] = field(default_factory=list)
    marks: list[tuple[float, str]] = field(default_factory=list)
    done: bool = False
    errors: list[dict[str, Any]] = field(default_factory=list)

    @property
    def tokens(self) -> int:
        """Events with a choice after the opening role event: a token each."""
        return sum(1 for e in self.events if e.get("choices")) - 1

    @property
    def text(self) -> str:
        return "".join(
            e["choices"][0]["delta"].get("content") or "" for e in self.events if e.get("choices")
        )

    def stall(self) -> float:
        """Seconds between the last event before the continuation's comment and the first
        after it: what the client waited across the cut."""
        at = next(k for k, (_, kind) in enumerate(self.marks) if kind == "comment")
        before = max(t for t, kind in self.marks[:at] if kind == "event")
        after = min(t for t, kind in self.marks[at:] if kind == "event")
        return after - before

    def usage(self) -> dict[str, Any]:
        found = [e["usage"] for e in self.events if e.get("usage")]
        assert len(found) == 1, found
        return dict(found[0])


def read_sse(line: str, got: Streamed) -> None:
    now = time.monotonic()
    if line.startswith(":"):
        got.comments.append(line)
        got.marks.append((now, "comment"))
    elif line == "data: [DONE]":
        got.done = True
    elif line.startswith("data: "):
        doc = orjson.loads(line[6:])
        (got.errors if "error" in doc else got.events).append(doc)
        got.marks.append((now, "event"))


def body(content: str, max_tokens: int, **kw: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        **kw,
    }


def stream_killing(
    edge: EdgeProc, doc: dict[str, Any], after: int, kill: Any, key: str = KEY
) -> Streamed:
    """Stream ``doc``; after ``after`` events call ``kill(instance serving it)``."""
    got = Streamed()
    headers = {"Authorization": f"Bearer {key}"}
    with httpx.stream(
        "POST", edge.url + "/v1/chat/completions", json=doc, headers=headers, timeout=60
    ) as r:
        assert r.status_code == 200, r.read()
        got.instance = route_of(r.headers)["instance"]
        for line in r.iter_lines():
            before = len(got.events)
            read_sse(line, got)
            if len(got.events) == after > before:
                kill(got.instance)
    return got


def prompt_tokens(edge: EdgeProc, content: str) -> int:
    r = httpx.post(
        edge.url + "/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 1},
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=30,
    )
    return int(r.json()["usage"]["prompt_tokens"])


def metric(edge: EdgeProc, needle: str) -> float:
    for line in httpx.get(edge.ops + "/metrics", timeout=5).text.splitlines():
        if needle in line and not line.startswith("#"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_a_killed_engines_stream_goes_on_elsewhere_billed_once(
    tmp_path: Path, usage: redis.Redis
) -> None:
    with sims(tmp_path, ["a", "b"]) as engines:
        edge = metered_edge(tmp_path, "r1", list(engines.values()))
        content = "Tell me a long story about the sea."
        p1 = prompt_tokens(edge, content)
        got = stream_killing(
            edge, body(content, 200, ignore_eos=True), 20, lambda i: engines[i].kill()
        )
        edge.proc.stop()  # flushes the spool: every record is shipped

    # One complete, well-formed stream: one id, every token once, one finish, one usage.
    assert got.done and not got.errors
    assert {e["id"] for e in got.events} == {got.events[0]["id"]}
    finishes = [e["choices"][0]["finish_reason"] for e in got.events if e.get("choices")]
    assert finishes[-1] == "length" and not any(finishes[:-1])
    assert [e["choices"][0]["delta"].get("role") for e in got.events if e.get("choices")].count(
        "assistant"
    ) == 1
    assert got.tokens == 200
    counts = {k: v for k, v in got.usage().items() if k != "prompt_tokens_details"}
    assert counts == {"prompt_tokens": p1, "completion_tokens": 200, "total_tokens": p1 + 200}
    other = "b" if got.instance == "a" else "a"
    assert got.comments == [
        f": x-fedinfer-route continued region=r1 instance={other} after=engine_lost leg=2"
    ]

    (record,) = [r for r in records(usage, 2) if r.continued]
    assert (record.prompt_tokens, record.completion_tokens) == (p1, 200)
    assert record.legs == f"r1/{got.instance},r1/{other}" and record.instance == other
    assert record.continuation_reason == "engine_lost"
    # The second engine read the prompt and the 19 tokens relayed before the cut again.
    assert record.reprefill_tokens == p1 + 19
    assert record.status == 200 and record.usage_reported


def test_what_cannot_be_continued_ends_with_the_reason(tmp_path: Path, usage: redis.Redis) -> None:
    with sims(tmp_path, ["a", "b", "c"]) as engines:
        edge = metered_edge(tmp_path, "r1", list(engines.values()), "--continue-memory", "3000")

        def kill(instance: str) -> None:
            engines[instance].kill()

        # A seeded answer is one the client can reproduce: another engine's would not be it.
        seeded = stream_killing(
            edge, body("A seeded tale.", 200, seed=7, ignore_eos=True), 10, kill
        )
        # Continuable, but longer than the edge keeps (--continue-memory): cut, saying why.
        long = stream_killing(edge, body("A long tale.", 200, ignore_eos=True), 40, kill)
        for got, why in ((seeded, "seeded"), (long, "too_long")):
            assert not got.done and len(got.errors) == 1
            error = got.errors[0]["error"]
            assert error["code"] == "upstream_stream_cut"
            assert f"(not continued: {why})" in error["message"]
            assert metric(edge, f'outcome="cut_{why}",reason="engine_lost"') == 1.0
        edge.proc.stop()
    # Billed for what reached the client, as a cut stream always was.
    cut = sorted((r.completion_tokens, r.status, r.usage_reported) for r in records(usage, 2))
    assert cut == sorted((g.tokens, 502, False) for g in (seeded, long))


async def _one_of_many(
    client: httpx.AsyncClient, url: str, k: int, started: asyncio.Event, got: Streamed
) -> None:
    doc = body(f"conversation {k}: " + "tell me more. " * (k % 7), 240, ignore_eos=True)
    async with client.stream(
        "POST", url, json=doc, headers={"Authorization": f"Bearer {KEY}"}
    ) as r:
        assert r.status_code == 200
        got.instance = route_of(r.headers)["instance"]
        async for line in r.aiter_lines():
            read_sse(line, got)
            if len(got.events) == 12:
                started.set()


async def _many(edge: EdgeProc, n: int, kill: Any) -> list[Streamed]:
    got = [Streamed() for _ in range(n)]
    events = [asyncio.Event() for _ in range(n)]
    limits = httpx.Limits(max_connections=n + 8, max_keepalive_connections=n + 8)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        url = edge.url + "/v1/chat/completions"
        tasks = [
            asyncio.create_task(_one_of_many(client, url, k, events[k], got[k])) for k in range(n)
        ]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), 60)
        await asyncio.to_thread(kill, got)
        await asyncio.gather(*tasks)
    return got


def test_a_hundred_streams_survive_the_engine_serving_a_third_of_them(
    tmp_path: Path, usage: redis.Redis
) -> None:
    with sims(tmp_path, ["a", "b", "c"], "--max-num-seqs", "64") as engines:
        edge = metered_edge(tmp_path, "r1", list(engines.values()))
        victims: list[str] = []

        def kill(got: list[Streamed]) -> None:
            counts = {name: sum(1 for g in got if g.instance == name) for name in engines}
            victim = max(counts, key=lambda name: counts[name])
            victims.append(victim)
            engines[victim].kill()

        got = asyncio.run(_many(edge, 100, kill))
        edge.proc.stop()
    (victim,) = victims
    moved = [g for g in got if g.instance == victim]
    assert len(moved) >= 25
    # Zero streams end in an error; each is whole.
    assert [g.errors for g in got] == [[]] * 100
    assert all(g.done and g.tokens == 240 for g in got)
    assert all(len(g.comments) == 1 for g in moved)
    # From the cut to the next token: the re-prefill of a short conversation, plus at most 1 s.
    gaps = sorted(g.stall() for g in moved)
    median, worst = gaps[len(gaps) // 2], gaps[-1]
    print(f"{len(moved)} moved; cut to next token: median {median:.3f} s, max {worst:.3f} s")
    assert gaps[int(0.99 * (len(gaps) - 1))] < 1.0, gaps
    # The usage report equals what the clients received, exactly: one record a stream.
    recs = records(usage, 100)
    assert len(recs) == 100
    assert sorted(r.completion_tokens for r in recs) == sorted(g.tokens for g in got)
    assert sorted(r.prompt_tokens for r in recs) == sorted(g.usage()["prompt_tokens"] for g in got)
    assert sum(1 for r in recs if r.continued) == len(moved)
    assert {r.continuation_reason for r in recs if r.continued} == {"engine_lost"}


def test_a_drained_instances_streams_move_within_seconds(tmp_path: Path) -> None:
    with sims(tmp_path, ["a", "b"]) as engines:
        doc = table_doc("r1", 1, [inst(s) for s in engines.values()])
        edge = start_edge(tmp_path, doc, "--drain-migrate-after", "0.5")
        got: list[Streamed] = []

        def drain(instance: str) -> None:
            # The control plane drains it: the next table leaves it out.
            kept = [inst(s) for s in engines.values() if s.name != instance]
            edge.table.write_text(json.dumps(table_doc("r1", 2, kept)))
            got.append(Streamed(instance=instance))
            got[0].marks.append((time.monotonic(), "drain"))

        with ExitStack():
            result = stream_killing(edge, body("A drained tale.", 300, ignore_eos=True), 10, drain)
        drained = engines[result.instance]
        started = got[0].marks[0][0]
        wait_until(
            lambda: (
                httpx.get(drained.url + "/metrics", timeout=5).text.count(
                    "vllm:num_requests_running"
                )
                > 0
                and _running(drained.url) == 0
            ),
            what="the drained engine idle",
            timeout=5,
        )
        idle_after = time.monotonic() - started
        assert result.done and not result.errors and result.tokens == 300
        assert len(result.comments) == 1 and "after=drain" in result.comments[0]
        assert idle_after < 5.0
        assert metric(edge, 'outcome="continued",reason="drain"') == 1.0
        # A drain is not a failure: the instance was not counted unhealthy.
        assert metric(edge, f'fedinfer_edge_ejections_total{{instance="{result.instance}"}}') == 0
        edge.proc.stop()


def _running(url: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=5).text.splitlines():
        if line.startswith("vllm:num_requests_running"):
            return float(line.rsplit(" ", 1)[1])
    return -1.0


def test_a_dark_regions_streams_go_on_where_the_tenant_may_be_served(
    tmp_path: Path, usage: redis.Redis
) -> None:
    """Every engine of r1 killed under two streams: the tenant that may use r2 gets its answer
    from there, billed once (by r1, where it entered); the tenant held to r1 gets a clean end
    with the reason."""
    hop_file = tmp_path / "hop-keys"
    hop_file.write_text(HOP_KEYS)
    with sims(tmp_path, ["a", "c", "b"]) as engines:
        r2 = metered_edge(tmp_path, "r2", [engines["b"]], "--hop-keys-file", str(hop_file))
        doc = table_doc("r1", 1, [inst(engines["a"]), inst(engines["c"])])
        doc["tenants"] = _tenants(["r1", "r2"])
        doc["remote_regions"] = [
            {"code": "r2", "edge_url": r2.url, "rtt_ms": 5, "models": [MODEL], "headroom": 0.5}
        ]
        (tmp_path / "r1").mkdir()
        r1 = start_edge(
            tmp_path / "r1",
            doc,
            *stream_args(tmp_path / "r1", "edge-r1"),
            "--usage-spool-dir",
            str(tmp_path / "r1" / "spool"),
            "--usage-redis-url",
            REDIS_URL,
            "--hop-keys-file",
            str(hop_file),
            "--eject-after",
            "1",
        )
        both = threading.Barrier(3)

        def after_20(instance: str) -> None:
            both.wait(timeout=30)

        with ThreadPoolExecutor(2) as pool:
            free = pool.submit(
                stream_killing, r1, body("Sail on.", 120, ignore_eos=True), 20, after_20
            )
            held = pool.submit(
                stream_killing, r1, body("Stay.", 120, ignore_eos=True), 20, after_20, HELD_KEY
            )
            both.wait(timeout=30)
            engines["a"].kill()
            engines["c"].kill()
            free_got, held_got = free.result(), held.result()
        r1.proc.stop()
        r2.proc.stop()

    assert free_got.done and not free_got.errors and free_got.tokens == 120
    assert free_got.comments == [": x-fedinfer-route continued region=r2 after=engine_lost leg=2"]
    assert not held_got.done and len(held_got.errors) == 1
    assert "(not continued: no_instance)" in held_got.errors[0]["error"]["message"]
    # One record each, both written where they entered: r2 metered nothing of its own.
    recs = records(usage, 2)
    assert len(recs) == 2 and {r.region for r in recs} == {"r1"}
    (moved,) = [r for r in recs if r.continued]
    assert moved.legs == f"r1/{free_got.instance},r2/b"
    assert (moved.completion_tokens, moved.status) == (120, 200)
    assert moved.prompt_tokens == free_got.usage()["prompt_tokens"]
    (cut,) = [r for r in recs if not r.continued]
    assert (cut.completion_tokens, cut.status) == (held_got.tokens, 502)


def test_a_drained_stream_with_nowhere_to_go_runs_to_its_end(tmp_path: Path) -> None:
    """The region's last instance drained (its region evacuated, no other region listed): the
    edge does not give its stream up, which ends where it runs."""
    with sims(tmp_path, ["a"]) as engines:
        edge = start_edge(
            tmp_path, table_doc("r1", 1, [inst(engines["a"])]), "--drain-migrate-after", "0"
        )

        def drain(instance: str) -> None:
            edge.table.write_text(json.dumps(table_doc("r1", 2, [])))
            wait_until(
                lambda: httpx.get(edge.ops + "/healthz", timeout=5).json()["table_version"] == 2,
                what="the table without it applied",
                timeout=5,
            )
            time.sleep(0.5)  # two of the drain watch's looks, while the stream runs on

        got = stream_killing(edge, body("The last tale.", 300, ignore_eos=True), 10, drain)
        assert got.done and not got.errors and got.tokens == 300 and not got.comments
        assert metric(edge, "fedinfer_edge_continuations_total{") == 0.0
        edge.proc.stop()


def test_a_client_cannot_pass_its_request_off_as_a_continuation(
    tmp_path: Path, usage: redis.Redis
) -> None:
    """The continuation marker counts only under a fellow edge's hop signature over the body
    and the marker: a client that sends it (with a forged hop, or with a hop signed for the
    body alone) is metered as usual."""
    hop_file = tmp_path / "hop-keys"
    hop_file.write_text(HOP_KEYS)
    with sims(tmp_path, ["a"]) as engines:
        edge = metered_edge(tmp_path, "r1", [engines["a"]], "--hop-keys-file", str(hop_file))
        doc = {"model": MODEL, "messages": [{"role": "user", "content": "free?"}], "max_tokens": 3}
        raw = orjson.dumps(doc)
        keys = hop_keys(parse_key_ring(HOP_KEYS))
        signed_for_body = sign_hop(keys, "r2", "r1", f"Bearer {KEY}".encode(), raw, now_ms())
        for hop in (b"v2.r2.r1.00.0.h1.forged", signed_for_body):
            r = httpx.post(
                edge.url + "/v1/chat/completions",
                content=raw,
                headers={
                    "Authorization": f"Bearer {KEY}",
                    "content-type": "application/json",
                    "x-fedinfer-hop": hop.decode(),
                    "x-fedinfer-continuation": "1",
                },
                timeout=30,
            )
            assert r.status_code == 200, r.text
        edge.proc.stop()
    recs = records(usage, 2)
    assert [(r.tenant, r.completion_tokens) for r in recs] == [("acme", 3), ("acme", 3)]
