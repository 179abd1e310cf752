"""The record stage: which requests are metered, with which tokens, and what the heartbeat's
demand counts — an engine's answer or a stream the client left is usage; an engine's refusal,
or an answer from another region, is not metered here."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from regions.edge.http.endpoints import CHAT, TOKENIZE
from regions.edge.http.parse import UsageTap, parse_request
from regions.edge.metering.meter import Meter, MeteringConfig
from regions.edge.observability import EdgeMetrics
from regions.edge.policy.admission import Admission
from regions.edge.policy.budget import Budgets
from regions.edge.policy.scheduler import Decision, Scored
from regions.edge.stages.context import RequestContext
from regions.edge.stages.record import Recorder
from regions.edge.view.load import LoadBoard
from regions.tables.schema import Instance
from regions.tables.usage import decode_record, encode_usage_lines

INST = Instance(id="us-1", url="http://e:1", model="llama", adapters=("sql",))


class NoSink:
    async def send(self, data: bytes) -> None:
        raise AssertionError("not shipped in these tests")

    async def close(self) -> None:
        pass


@pytest.fixture
def recorder(tmp_path: Path) -> Recorder:
    meter = Meter(MeteringConfig(spool_dir=tmp_path), NoSink())
    loads = LoadBoard()
    loads.sync({"us-1": "m"})
    return Recorder(EdgeMetrics(), Admission("us-east"), loads, "us-east", meter, Budgets(None))


def ctx(model: str = "llama", stream: bool = False, **kw: Any) -> RequestContext:
    body = b'{"model": "%s", "messages": [{"role": "user", "content": "hello there"}]%s}' % (
        model.encode(),
        b', "stream": true' if stream else b"",
    )
    req = parse_request(body, endpoint=CHAT, bytes_per_token=4.0)
    fields: dict[str, Any] = {"served_by": INST, **kw}
    return RequestContext(req=req, send=None, traceparent="", arrived=time.perf_counter(), **fields)  # type: ignore[arg-type]


def recorded(recorder: Recorder) -> list[Any]:
    assert recorder.meter is not None
    rows = recorder.meter.spool.take_buffer()
    return [decode_record(line) for line in encode_usage_lines(rows).splitlines()]


def test_an_answer_is_metered_with_the_engines_counts(recorder: Recorder) -> None:
    c = ctx(model="sql", status=200, prompt_tokens=40, cached_tokens=16, used_tokens=52)
    recorder.finished(c)
    [r] = recorded(recorder)
    assert (r.prompt_tokens, r.cached_tokens, r.completion_tokens) == (40, 16, 12)
    assert (r.model, r.adapter, r.instance, r.region, r.entry_region) == (
        "llama", "sql", "us-1", "us-east", "us-east"
    )  # fmt: skip
    assert r.usage_reported and not r.cancelled and r.status == 200
    assert recorder.loads.get("us-1").tokens == 12  # output tokens join the heartbeat's demand


def test_a_stream_the_client_left_is_charged_what_was_relayed(recorder: Recorder) -> None:
    tap = UsageTap(strip=True)
    tap.feed(b"".join(b'data: {"choices": [{"delta": {"content": "x"}}]}\n\n' for _ in range(6)))
    c = ctx(stream=True, disconnected=True, tap=tap, entry_region="eu-west", key_prefix="fi_ab")
    recorder.finished(c)
    [r] = recorded(recorder)
    assert r.cancelled and not r.usage_reported and r.status == 499
    assert r.completion_tokens == 5  # six events, the first being the role chunk
    assert r.prompt_tokens == c.req.prompt_tokens
    assert (r.entry_region, r.key_prefix) == ("eu-west", "fi_ab")


def test_an_engines_refusal_and_a_remote_answer_are_not_metered(recorder: Recorder) -> None:
    recorder.finished(ctx(status=400))
    recorder.finished(ctx(status=502))  # failed before any token reached the client
    recorder.finished(ctx(served_by=None, status=200))  # another region's edge served it
    assert recorded(recorder) == []
    assert recorder.loads.get("us-1").tokens == 0


def test_a_full_spool_refuses_or_drops_by_policy(tmp_path: Path) -> None:
    refuse = Meter(MeteringConfig(spool_dir=tmp_path / "a", max_bytes=100), NoSink())
    serve = Meter(
        MeteringConfig(spool_dir=tmp_path / "b", max_bytes=100, full_policy="serve"), NoSink()
    )
    for meter in (refuse, serve):
        recorder = Recorder(EdgeMetrics(), Admission("r"), LoadBoard(), "r", meter, Budgets(None))
        recorder.finished(ctx(status=200, prompt_tokens=1, used_tokens=2))
        assert not meter.spool.full
        meter.spool.write(meter.spool.take_buffer())  # a flush: one record is over 100 bytes
        assert meter.spool.full
        for _ in range(2):
            recorder.finished(ctx(status=200, prompt_tokens=1, used_tokens=2))
    assert refuse.refuse_when_full and refuse.recorded == 3  # admitted ones are still recorded
    assert not serve.refuse_when_full and (serve.recorded, serve.dropped) == (1, 2)


def test_a_tokenizer_call_counts_its_status_but_no_times_and_no_usage(
    recorder: Recorder,
) -> None:
    body = b'{"model": "llama", "prompt": "hello there"}'
    req = parse_request(body, endpoint=TOKENIZE, bytes_per_token=4.0)
    c = RequestContext(
        req=req, send=None, traceparent="", arrived=time.perf_counter(), served_by=INST
    )  # type: ignore[arg-type]
    decision = Decision(Scored("us-1", 0.0, 0.0, 0.0, 0, 0), None, "unqueued")
    recorder.served(c, decision, "us-1", 200, 0.001, None, None)
    series = recorder.metrics.series("llama", "us-1")
    assert series.statuses == {200: 1}
    assert sum(series.ttft.counts) == sum(series.e2e.counts) == 0
    assert c.ttft_s is None
    recorder.finished(c)
    assert recorded(recorder) == []
