"""``fedinfer engine-sim`` as a real process on loopback, driven with the official openai SDK."""

from __future__ import annotations

import re
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from regions.engines.accelerators import accelerator
from regions.engines.metrics import parse_vllm_metrics
from regions.engines.simulator.perf import PerfModel
from regions.supervisor import Process, start_process, wait_until

FEDINFER = str(Path(sys.executable).with_name("fedinfer"))
MODEL = "meta-llama/Llama-3.1-8B-Instruct"
READY = re.compile(r"engine-sim: engine (\d+) listening on (http://\S+)")


@dataclass
class Sim:
    proc: Process
    urls: list[str]

    def sdk(self, i: int) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=self.urls[i] + "/v1", api_key="unused", max_retries=0, timeout=15
        )


@contextmanager
def engine_sim(*args: str, count: int = 2) -> Iterator[Sim]:
    cmd = [FEDINFER, "engine-sim", "--count", str(count), "--port", "0", *args]
    with tempfile.TemporaryDirectory() as tmp:
        proc = start_process("engine-sim", cmd, log=Path(tmp) / "engine-sim.log")

        def listening() -> dict[int, str]:
            return {int(m[1]): m[2] for m in READY.finditer(proc.output())}

        try:
            wait_until(lambda: len(listening()) >= count, what="engine-sim", watch=proc)
            urls = listening()
            yield Sim(proc, [urls[i] for i in range(count)])
        finally:
            proc.stop()
        # SIGTERM is a clean stop, and nothing went wrong inside (cut responses are silent).
        log = proc.output()
        assert proc.returncode == 0, log
        assert "Traceback" not in log and "ERROR" not in log, log


@pytest.fixture(scope="module")
def sim() -> Iterator[Sim]:
    with engine_sim("--num-gpu-blocks", "4096", "--max-model-len", "8192", "--seed", "3") as s:
        yield s


LONG_SYSTEM = "You are the billing assistant of a large company. " * 60


def test_sdk_chat_streaming_and_not(sim: Sim) -> None:
    client = sim.sdk(0)
    assert [m.id for m in client.models.list()] == [MODEL]
    messages = [{"role": "user", "content": "Say hello."}]
    full = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8)
    assert full.id.startswith("chatcmpl-") and full.object == "chat.completion"
    assert full.choices[0].message.role == "assistant"
    assert full.usage is not None and full.usage.completion_tokens <= 8
    assert full.system_fingerprint and full.system_fingerprint.startswith("vllm-")

    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=8,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content  # same prompt, same (greedy) answer
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    assert chunks[-2].choices[0].finish_reason == full.choices[0].finish_reason


def test_repeated_long_prompt_is_served_from_the_prefix_cache(sim: Sim) -> None:
    client = sim.sdk(1)
    messages = [
        {"role": "system", "content": LONG_SYSTEM},
        {"role": "user", "content": "What is my balance?"},
    ]
    first = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4)
    second = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4)
    assert first.usage and second.usage
    assert first.usage.prompt_tokens_details
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached is not None and cached == (second.usage.prompt_tokens - 1) // 16 * 16 > 0
    # The other engine has its own cache: nothing cached there.
    elsewhere = sim.sdk(0).chat.completions.create(model=MODEL, messages=messages, max_tokens=4)
    assert elsewhere.usage and elsewhere.usage.prompt_tokens_details
    assert elsewhere.usage.prompt_tokens_details.cached_tokens == 0

    load = parse_vllm_metrics(httpx.get(sim.urls[1] + "/metrics", timeout=5).text)
    assert load.prefix_cache_hits_total >= cached
    assert load.prefix_cache_queries_total >= 2 * second.usage.prompt_tokens
    assert load.request_success_total >= 2
    assert load.model_names == (MODEL,) and load.num_gpu_blocks == 4096


def test_ttft_follows_the_performance_model(sim: Sim) -> None:
    """~4k uncached prompt tokens on an H100 take ~0.3 s to prefill; a cached one is fast."""
    client = sim.sdk(0)
    messages = [{"role": "user", "content": "Summarise: " + "lorem ipsum dolor sit amet " * 700}]

    def ttft() -> float:
        t0 = time.perf_counter()
        stream = client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=2, stream=True
        )
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                elapsed = time.perf_counter() - t0
                stream.close()
                return elapsed
        raise AssertionError("no token")

    cold, warm = ttft(), ttft()
    assert 0.15 < cold < 1.5
    assert warm < cold / 3


def test_inter_token_latency_is_the_modelled_decode_step(sim: Sim) -> None:
    def itl() -> tuple[float, float]:
        text = httpx.get(sim.urls[1] + "/metrics", timeout=5).text
        samples = {
            sample.name: sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
        }
        return (
            samples["vllm:inter_token_latency_seconds_sum"],
            samples["vllm:inter_token_latency_seconds_count"],
        )

    s0, c0 = itl()
    sim.sdk(1).completions.create(
        model=MODEL, prompt="count", max_tokens=60, extra_body={"ignore_eos": True}
    )
    s1, c1 = itl()
    assert c1 - c0 == 59
    modelled = PerfModel(accelerator("H100-80G")).step_time(0, 1, 40)
    mean = (s1 - s0) / (c1 - c0)
    # Never faster than the model; slower only by scheduling noise of a busy machine.
    print(f"\nmean inter-token latency {mean * 1e3:.2f} ms, modelled {modelled * 1e3:.2f} ms")
    assert modelled * 0.95 <= mean <= modelled * 3, (mean, modelled)


def test_sdk_completions(sim: Sim) -> None:
    client = sim.sdk(0)
    full = client.completions.create(model=MODEL, prompt="The edge routes", max_tokens=5)
    assert full.object == "text_completion" and full.id.startswith("cmpl-")
    chunks = list(
        client.completions.create(model=MODEL, prompt="The edge routes", max_tokens=5, stream=True)
    )
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text


def test_error_shapes_through_the_sdk(sim: Sim) -> None:
    client = sim.sdk(0)
    with pytest.raises(openai.NotFoundError) as not_found:
        client.chat.completions.create(
            model="no-such-model", messages=[{"role": "user", "content": "x"}]
        )
    assert not_found.value.status_code == 404
    assert not_found.value.body == {
        "message": f"The model `no-such-model` does not exist. Valid aliases: {MODEL}.",
        "type": "NotFoundError",
        "param": "model",
        "code": 404,
    }
    with pytest.raises(openai.BadRequestError) as overflow:
        client.completions.create(model=MODEL, prompt=list(range(1, 9000)), max_tokens=1)
    assert "maximum context length is 8192 tokens" in overflow.value.message
    r = httpx.post(
        sim.urls[0] + "/v1/chat/completions",
        content=b"{not json",
        headers={"content-type": "application/json"},
        timeout=5,
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "body.0"
    assert httpx.get(sim.urls[0] + "/health", timeout=5).status_code == 200


def test_faults_through_the_admin_endpoint(sim: Sim) -> None:
    admin = sim.urls[1] + "/admin/faults"
    client = sim.sdk(1)
    messages = [{"role": "user", "content": "faulty"}]
    try:
        assert httpx.post(admin, json={"error_rate": 1.0}, timeout=5).status_code == 200
        with pytest.raises(openai.InternalServerError):
            client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3)
        # The other engine of the process is unaffected.
        sim.sdk(0).chat.completions.create(model=MODEL, messages=messages, max_tokens=3)

        httpx.post(admin, json={"reset": True, "die_after_tokens": 3}, timeout=5)
        stream = client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=50,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        received = []
        with pytest.raises((httpx.RemoteProtocolError, openai.APIError)):
            for chunk in stream:
                received.append(chunk)
        assert len(received) == 4  # the role chunk and three tokens, then the cut

        httpx.post(admin, json={"reset": True, "health_fail": True}, timeout=5)
        assert httpx.get(sim.urls[1] + "/health", timeout=5).status_code == 503

        httpx.post(admin, json={"reset": True, "hang_rate": 1.0}, timeout=5)
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(
                sim.urls[1] + "/v1/chat/completions",
                json={"model": MODEL, "messages": messages},
                timeout=httpx.Timeout(5, read=0.5),
            )
        assert httpx.get(admin, timeout=5).json()["faults"]["hang_rate"] == 1.0
    finally:
        httpx.post(admin, json={"reset": True}, timeout=5)
    # The hung request was aborted when the client left: nothing keeps running.
    load = parse_vllm_metrics(httpx.get(sim.urls[1] + "/metrics", timeout=5).text)
    assert (load.num_requests_running, load.num_requests_waiting) == (0, 0)


def test_kill_stops_one_engine_and_cuts_its_streams() -> None:
    with engine_sim("--fault", "0:latency_ms=0") as sim:
        victim = sim.sdk(1)
        stream = victim.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "a long story"}],
            max_tokens=2000,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        first = next(iter(stream))
        assert first.choices[0].delta.role == "assistant"
        with ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(
                httpx.post,
                sim.urls[1] + "/v1/chat/completions",
                json={"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                      "max_tokens": 2000, "ignore_eos": True},
                timeout=10,
            )  # fmt: skip
            deadline = time.monotonic() + 10
            while (
                parse_vllm_metrics(
                    httpx.get(sim.urls[1] + "/metrics", timeout=5).text
                ).num_requests_running
                < 2
            ):  # both requests are inside the engine
                assert time.monotonic() < deadline
                time.sleep(0.02)
            r = httpx.post(sim.urls[1] + "/admin/faults", json={"kill": True}, timeout=5)
            assert r.json()["killed"] is True
            with pytest.raises((httpx.RemoteProtocolError, openai.APIError)):
                for _ in stream:
                    pass
            with pytest.raises(httpx.RemoteProtocolError):  # dropped, not answered with a 500
                waiting.result()
        deadline = time.monotonic() + 5
        while True:  # the listener closes within a server tick
            try:
                r = httpx.get(sim.urls[1] + "/health", timeout=1)
                raise AssertionError(f"a killed engine answered: {r.status_code}")
            except httpx.ConnectError:
                break
            except (httpx.RemoteProtocolError, httpx.ReadError):
                pass  # accepted in the instant before the listener closed, then dropped/reset
            assert time.monotonic() < deadline, "killed engine still accepts connections"
            time.sleep(0.05)
        ok = sim.sdk(0).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "still there?"}], max_tokens=2
        )
        assert ok.choices[0].message.content
