"""The edge learns an engine's real prefill speed (a real edge and engine-sim on loopback): with
a table claiming five times the engine's speed, sixty streamed answers bring the rate the
scheduler uses to within a fifth of the engine's own (in the edge's estimated tokens); with
--no-learn-speeds the table's figure stays.

The engine is the only one of its kind, so the rate in use is its kind's, followed in full
(``regions/edge/policy/speed.py``): no hysteresis band leaves it resting off the learned one.
(With a band on the scale itself it rested up to 15 % above: 3 of 6 local runs read 1.24 x the
engine's own, and the test, then asserting the fifth on the rate in use, failed in CI on
2026-12-02.)"""

from __future__ import annotations

import random
import re
import statistics
import time
from pathlib import Path

import httpx
import orjson
import pytest

from regions.engines.accelerators import accelerator
from regions.engines.simulator.perf import PerfModel, model_params_billion
from tests.integration.test_edge_support import engine_sims, start_edge, table_doc

MODEL = "sim-llama-8b"
WORDS = [
    "alpha",
    "bravo",
    "charlie",
    "delta",
    "echo",
    "foxtrot",
    "golf",
    "hotel",
    "india",
    "juliet",
    "kilo",
    "lima",
    "mike",
]


def true_rate() -> float:
    return PerfModel(
        accelerator("H100-80G"), 1, model_params_billion(MODEL)
    ).prefill_tokens_per_second()


def rate(ops: str, instance: str, source: str) -> float:
    text = httpx.get(ops + "/metrics", timeout=5).text
    m = re.search(
        rf'fedinfer_edge_prefill_tokens_per_s\{{instance="{instance}",source="{source}"\}} (\S+)',
        text,
    )
    assert m, text
    return float(m.group(1))


def stream_one(url: str, rand: random.Random) -> float:
    """One streamed request with a fresh ~3,000-token prompt (nothing cached); the edge's
    estimate of its prompt tokens (bytes / 4) over the engine's count."""
    prompt = " ".join(rand.choice(WORDS) for _ in range(2500))
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": 2,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    counted = 0
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {") and '"usage":{' in line:
                counted = orjson.loads(line[6:])["usage"]["prompt_tokens"]
    assert counted > 0
    return len(prompt.encode()) / 4 / counted


@pytest.mark.parametrize("learn", [True, False])
def test_a_table_five_times_too_fast_is_learned_from_the_answers(
    tmp_path: Path, learn: bool
) -> None:
    claimed = true_rate() * 5
    with engine_sims(tmp_path, 1, MODEL, "--accelerator", "H100-80G") as [engine]:
        doc = table_doc("r1", 1, [])
        doc["instances"] = [
            {"id": "e0", "url": engine["url"], "model": MODEL, "prefill_tokens_per_s": claimed}
        ]
        edge = start_edge(tmp_path, doc, *([] if learn else ["--no-learn-speeds"]))
        try:
            rand = random.Random(7)
            estimate = statistics.fmean(stream_one(edge.url, rand) for _ in range(60))
            learned = rate(edge.ops, "e0", "observed")
            in_use = rate(edge.ops, "e0", "learned")
        finally:
            edge.proc.stop()
    if learn:
        # The edge counts prompts by its own estimate, so it learns estimated tokens per second.
        assert in_use == pytest.approx(true_rate() * estimate, rel=0.2), (in_use, estimate)
        assert in_use == pytest.approx(learned, rel=1e-6)
    else:
        assert learned == in_use == claimed


def full_batch_step(ops: str, instance: str) -> dict[str, float]:
    text = httpx.get(ops + "/metrics", timeout=5).text
    found = re.findall(
        rf'fedinfer_edge_full_batch_step_seconds\{{instance="{instance}",source="(\w+)"\}} (\S+)',
        text,
    )
    return {source: float(value) for source, value in found}


def test_the_engines_own_decode_step_is_read_from_its_histogram(tmp_path: Path) -> None:
    """Streams of 64 tokens through the edge, one at a time: the step the edge reads from the
    engine's ``vllm:inter_token_latency_seconds`` is what that histogram says of a batch of
    one, kept as a full batch's (x 2 / (1 + 1/16) by the prior's shape, decode_slowdown 1).

    Judged against the engine's own histogram, not the simulator's model: the simulator, like
    vLLM, reports the gaps it really took, which a loaded machine stretches (21 ms a step for a
    modelled 8.5 in one CI run beside a hundred-stream test)."""
    perf = PerfModel(accelerator("H100-80G"), 1, model_params_billion(MODEL))
    lone = perf.step_time(0, 1, 300)
    with engine_sims(tmp_path, 1, MODEL, "--accelerator", "H100-80G") as [engine]:
        doc = table_doc("r1", 1, [])
        doc["instances"] = [{"id": "e0", "url": engine["url"], "model": MODEL}]
        edge = start_edge(tmp_path, doc)
        try:
            assert full_batch_step(edge.ops, "e0") == {}  # not measured before any token
            body = {"model": MODEL, "messages": [{"role": "user", "content": "hi " * 200}],
                    "max_tokens": 64, "ignore_eos": True, "stream": True}  # fmt: skip
            for _ in range(12):
                with httpx.stream("POST", edge.url + "/v1/chat/completions", json=body,
                                  timeout=30) as r:  # fmt: skip
                    assert r.status_code == 200
                    for _line in r.iter_lines():
                        pass
            deadline = time.monotonic() + 10
            while not (step := full_batch_step(edge.ops, "e0")):
                assert time.monotonic() < deadline, "no step measured"
                time.sleep(0.2)
            reported = engine_itl_mean(engine["url"])
        finally:
            edge.proc.stop()
    assert step["used"] == step["observed"]  # the only one of its kind
    assert reported >= 0.95 * lone  # the engine is never faster than its model
    # Readings land between streams as well as in them: the batch read is 0..1 of 16.
    assert 2 / (1 + 1 / 16) * reported * 0.8 <= step["used"] <= 2 * reported * 1.2, (
        step,
        reported,
        lone,
    )


def engine_itl_mean(url: str) -> float:
    """The mean gap between tokens the engine reports (its histogram's sum over its count)."""
    text = httpx.get(url + "/metrics", timeout=5).text
    total = count = 0.0
    for line in text.splitlines():
        if line.startswith("vllm:inter_token_latency_seconds_sum"):
            total += float(line.rsplit(" ", 1)[1])
        elif line.startswith("vllm:inter_token_latency_seconds_count"):
            count += float(line.rsplit(" ", 1)[1])
    assert count > 0, "no inter-token latency reported"
    return total / count
