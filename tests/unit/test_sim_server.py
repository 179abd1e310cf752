"""The simulator's HTTP API, driven in-process through ASGI (no sockets), checked against
responses captured from a real vLLM 0.32 server in ``tests/fixtures/vllm``."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from regions.engines.metrics import parse_vllm_metrics
from regions.engines.simulator.engine import EngineConfig, SimEngine
from regions.engines.simulator.faults import FaultConfig
from regions.engines.simulator.server import EngineApp

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "vllm"
needs_captures = pytest.mark.skipif(
    not (FIXTURES / "index.json").exists(), reason="no real vLLM captures"
)


@dataclass
class Response:
    status: int
    headers: dict[str, str]
    body: bytes
    complete: bool

    def json(self) -> Any:
        return orjson.loads(self.body)

    def events(self) -> list[Any]:
        out = []
        for block in self.body.decode().split("\n\n"):
            if block:
                assert block.startswith("data: ")
                payload = block[len("data: ") :]
                out.append(payload if payload == "[DONE]" else json.loads(payload))
        return out


async def call(
    app: EngineApp,
    method: str,
    path: str,
    body: Any = None,
    *,
    raw: bytes | None = None,
    content_type: str = "application/json",
    disconnect_after_bodies: int | None = None,
) -> Response:
    data = raw if raw is not None else (b"" if body is None else orjson.dumps(body))
    scope = {
        "type": "http",
        "method": method,
        "path": path,
        "headers": [(b"content-type", content_type.encode())],
    }
    gone = asyncio.Event()
    delivered = False
    messages: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": data, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        messages.append(message)
        bodies = sum(1 for m in messages if m["type"] == "http.response.body")
        if disconnect_after_bodies is not None and bodies >= disconnect_after_bodies:
            gone.set()

    task = asyncio.ensure_future(app(scope, receive, send))
    if disconnect_after_bodies == 0:
        await asyncio.sleep(0.05)
        gone.set()
    await asyncio.wait_for(task, 10.0)
    start = next((m for m in messages if m["type"] == "http.response.start"), None)
    bodies = [m for m in messages if m["type"] == "http.response.body"]
    return Response(
        status=start["status"] if start else 0,
        headers={k.decode(): v.decode() for k, v in (start["headers"] if start else [])},
        body=b"".join(m.get("body", b"") for m in bodies),
        complete=bool(bodies) and not bodies[-1].get("more_body", False),
    )


def with_engine(test: Callable[[EngineApp, SimEngine], Awaitable[None]], **overrides: Any) -> None:
    config = EngineConfig(
        model="var/tiny-llama",
        served_model_names=("tiny-llama",),
        accelerator="B200",
        num_gpu_blocks=4096,
        max_model_len=1024,
        **overrides,
    )

    async def main() -> None:
        engine = SimEngine(config)
        loop_task = asyncio.ensure_future(engine.run())
        try:
            await test(EngineApp(engine), engine)
        finally:
            engine.close()
            await asyncio.wait_for(loop_task, 5)

    asyncio.run(main())


def shape(value: Any) -> Any:
    """The structure of a JSON value: keys in order, value types, nulls."""
    if isinstance(value, dict):
        return [(k, shape(v)) for k, v in value.items()]
    if isinstance(value, list):
        return [shape(v) for v in value]
    if value is None:
        return None
    return "number" if isinstance(value, int | float) else type(value).__name__


CHAT = "/v1/chat/completions"


@needs_captures
def test_responses_have_the_shape_of_real_vllm() -> None:
    index = json.loads((FIXTURES / "index.json").read_text())

    async def check(app: EngineApp, engine: SimEngine) -> None:
        for name in ("chat.json", "completion.json", "models.json", "error_unknown_model.json"):
            entry = index[name]
            req = entry["request"]
            resp = await call(app, req["method"], req["path"], req.get("json"))
            real = json.loads((FIXTURES / name).read_text())
            assert resp.status == entry["status"], name
            assert resp.headers["content-type"] == entry["content_type"], name
            if name == "models.json":
                real["data"][0]["root"] = "var/tiny-llama"
            assert shape(resp.json()) == shape(real), name
        unknown = await call(
            app, "POST", CHAT, index["error_unknown_model.json"]["request"]["json"]
        )
        assert unknown.json() == json.loads((FIXTURES / "error_unknown_model.json").read_text())
        missing = await call(
            app, "POST", CHAT, index["error_missing_messages.json"]["request"]["json"]
        )
        assert missing.json() == json.loads((FIXTURES / "error_missing_messages.json").read_text())
        overflow = await call(
            app, "POST", CHAT, index["error_context_overflow.json"]["request"]["json"]
        )
        assert overflow.status == 400
        assert overflow.json() == json.loads((FIXTURES / "error_context_overflow.json").read_text())
        for name in ("chat_stream.txt", "completion_stream.txt"):
            entry = index[name]
            req = entry["request"]
            resp = await call(app, "POST", req["path"], {**req["json"], "ignore_eos": True})
            assert resp.headers["content-type"] == entry["content_type"]
            real_events = Response(200, {}, (FIXTURES / name).read_bytes(), True).events()
            ours = resp.events()
            assert len(ours) == len(real_events), name
            assert [shape(e) for e in ours] == [shape(e) for e in real_events], name

    with_engine(check)


@needs_captures
def test_repeated_long_prompt_reports_cached_tokens_like_vllm() -> None:
    index = json.loads((FIXTURES / "index.json").read_text())
    body = index["chat_prefix_first.json"]["request"]["json"]

    async def check(app: EngineApp, engine: SimEngine) -> None:
        first = (await call(app, "POST", CHAT, body)).json()
        second = (await call(app, "POST", CHAT, body)).json()
        prompt = second["usage"]["prompt_tokens"]
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == (prompt - 1) // 16 * 16
        assert (
            first["choices"][0]["message"]["content"] == second["choices"][0]["message"]["content"]
        )
        load = parse_vllm_metrics((await call(app, "GET", "/metrics")).body.decode())
        assert load.prefix_cache_queries_total == 2 * prompt
        assert load.prefix_cache_hits_total == (prompt - 1) // 16 * 16
        assert load.request_success_total == 2
        assert load.model_names == ("tiny-llama",) and load.block_size == 16
        samples = {
            sample.name: sample.value
            for family in text_string_to_metric_families(engine.metrics_text().decode())
            for sample in family.samples
        }
        assert samples["vllm:time_to_first_token_seconds_count"] == 2
        tokens = first["usage"]["completion_tokens"] + second["usage"]["completion_tokens"]
        assert samples["vllm:inter_token_latency_seconds_count"] == tokens - 2
        assert samples["vllm:e2e_request_latency_seconds_count"] == 2
        assert (await call(app, "POST", "/reset_prefix_cache")).status == 200
        third = (await call(app, "POST", CHAT, body)).json()
        assert third["usage"]["prompt_tokens_details"]["cached_tokens"] == 0

    with_engine(check)


def test_stream_usage_and_fingerprint_placement() -> None:
    async def check(app: EngineApp, engine: SimEngine) -> None:
        base = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True}
        events = (await call(app, "POST", CHAT, base)).events()
        assert events[-1] == "[DONE]"
        assert events[-2]["system_fingerprint"] == engine.system_fingerprint  # on the last chunk
        assert "usage" not in events[-2]
        with_usage = {
            **base,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        }
        events = (await call(app, "POST", CHAT, with_usage)).events()
        assert "system_fingerprint" not in events[-3]
        assert [e["usage"]["completion_tokens"] for e in events[1:-2]] == list(
            range(1, len(events) - 2)
        )
        assert events[-2]["choices"] == [] and events[-2]["usage"]["prompt_tokens"] > 0
        no_stream = {**base, "stream": False, "stream_options": {"include_usage": True}}
        bad = await call(app, "POST", CHAT, no_stream)
        assert bad.status == 400 and "stream=True" in bad.json()["error"]["message"]

    with_engine(check)


def test_max_tokens_rules() -> None:
    async def check(app: EngineApp, engine: SimEngine) -> None:
        msg = [{"role": "user", "content": "hi"}]
        r = await call(
            app,
            "POST",
            CHAT,
            {"messages": msg, "max_completion_tokens": 2, "max_tokens": 9, "ignore_eos": True},
        )
        assert r.json()["usage"]["completion_tokens"] == 2
        r = await call(app, "POST", CHAT, {"messages": msg, "max_tokens": 5000})
        assert r.status == 400 and r.json()["error"]["param"] == "max_tokens"
        r = await call(app, "POST", CHAT, {"messages": msg, "max_tokens": "many"})
        assert r.status == 400 and r.json()["error"]["param"] == "body.max_tokens"
        r = await call(app, "POST", "/v1/completions", {"prompt": "The edge", "ignore_eos": True})
        assert r.json()["usage"]["completion_tokens"] == 16  # vLLM's completions default
        r = await call(app, "POST", "/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 2})
        assert r.json()["usage"]["prompt_tokens"] == 3
        r = await call(app, "POST", "/v1/completions", {"prompt": "x" * 30_000})
        assert r.status == 400 and r.json()["error"]["param"] == "input_text"
        r = await call(app, "POST", "/v1/completions", {"prompt": ["a", "b"]})
        assert r.status == 400 and r.json()["error"]["param"] == "prompt"

    with_engine(check)


def test_request_errors_have_vllm_shapes() -> None:
    async def check(app: EngineApp, engine: SimEngine) -> None:
        r = await call(app, "POST", CHAT, raw=b'{"messages": [')
        err = r.json()["error"]
        assert (r.status, err["type"], err["param"], err["code"]) == (
            400,
            "Bad Request",
            "body.0",
            400,
        )
        assert "json_invalid" in err["message"]
        r = await call(app, "POST", CHAT, {"messages": []}, content_type="text/plain")
        assert r.status == 400 and "application/json" in r.json()["error"]["message"]
        r = await call(app, "POST", CHAT, [1, 2])
        assert r.status == 400
        r = await call(app, "GET", CHAT)
        assert r.status == 405
        r = await call(app, "GET", "/nope")
        assert (r.status, r.json()) == (404, {"detail": "Not Found"})

    with_engine(check)


def test_client_disconnect_aborts_and_frees_blocks() -> None:
    async def check(app: EngineApp, engine: SimEngine) -> None:
        body = {
            "messages": [{"role": "user", "content": "tell me a long story " * 20}],
            "max_tokens": 500,
            "ignore_eos": True,
            "stream": True,
        }
        r = await call(app, "POST", CHAT, body, disconnect_after_bodies=3)
        assert not r.complete
        await asyncio.sleep(0.02)
        assert engine.kv.usage == 0.0 and not engine.scheduler.has_work()
        load = parse_vllm_metrics(engine.metrics_text().decode())
        assert load.request_success_total == 1
        abort_line = (
            'vllm:request_success_total{engine="0",finished_reason="abort",'
            'model_name="tiny-llama"} 1.0'
        )
        assert abort_line in engine.metrics_text().decode().splitlines()
        # Non-streaming requests are aborted too.
        r = await call(app, "POST", CHAT, {**body, "stream": False}, disconnect_after_bodies=0)
        assert r.status == 0
        await asyncio.sleep(0.02)
        assert engine.kv.usage == 0.0

    with_engine(check)


def test_faults_by_admin_endpoint() -> None:
    async def check(app: EngineApp, engine: SimEngine) -> None:
        msg = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "ignore_eos": True}
        r = await call(app, "POST", "/admin/faults", {"error_rate": 1, "health_fail": True})
        assert r.json()["faults"]["error_rate"] == 1.0
        assert (await call(app, "GET", "/health")).status == 503
        r = await call(app, "POST", CHAT, msg)
        assert r.status == 500 and r.json()["error"]["type"] == "InternalServerError"
        await call(app, "POST", "/admin/faults", {"reset": True, "die_after_tokens": 2})
        r = await call(app, "POST", CHAT, {**msg, "stream": True})
        assert r.status == 200 and not r.complete
        assert [e["choices"][0]["delta"].get("content") is not None for e in r.events()] == [
            True
        ] * 3
        r = await call(app, "POST", CHAT, msg)
        assert r.status == 200 and not r.complete and int(r.headers["content-length"]) > len(r.body)
        await call(app, "POST", "/admin/faults", {"reset": True, "hang_rate": 1})
        r = await call(app, "POST", CHAT, msg, disconnect_after_bodies=0)
        assert r.status == 0  # accepted, never answered
        await call(app, "POST", "/admin/faults", {"reset": True, "latency_ms": 150})
        t0 = asyncio.get_running_loop().time()
        assert (await call(app, "POST", CHAT, msg)).status == 200
        assert asyncio.get_running_loop().time() - t0 >= 0.15
        r = await call(app, "POST", "/admin/faults", {"error_rate": 2})
        assert r.status == 400
        r = await call(app, "GET", "/admin/faults")
        assert r.json()["faults"]["latency_ms"] == 150 and r.json()["killed"] is False

    with_engine(check)


def test_faults_by_flag_and_kill_cuts_open_streams() -> None:
    async def check(app: EngineApp, engine: SimEngine) -> None:
        assert (await call(app, "GET", "/health")).status == 503
        killed = []
        app.on_kill = lambda: killed.append(True)
        body = {
            "messages": [{"role": "user", "content": "long"}],
            "max_tokens": 900,
            "ignore_eos": True,
            "stream": True,
        }
        stream = asyncio.ensure_future(call(app, "POST", CHAT, body))
        full = asyncio.ensure_future(call(app, "POST", CHAT, {**body, "stream": False}))
        await asyncio.sleep(0.05)
        r = await call(app, "POST", "/admin/faults", {"kill": True})
        assert r.json()["killed"] is True
        for cut in (await stream, await full):
            assert cut.status == 200 and not cut.complete  # dropped, not a 500
        late = await call(app, "GET", "/health")  # between the kill and the listener closing
        assert late.status == 200 and not late.complete
        assert killed == [True] and engine.killed

    with_engine(check, faults=FaultConfig(health_fail=True))


def test_lora_adapters_load_list_serve_and_unload() -> None:
    async def check(app: EngineApp, engine: SimEngine) -> None:
        r = await call(
            app, "POST", "/v1/load_lora_adapter", {"lora_name": "sql", "lora_path": "/a/sql"}
        )
        assert (r.status, r.body) == (200, b"Success: LoRA adapter 'sql' added successfully.")
        r = await call(
            app, "POST", "/v1/load_lora_adapter", {"lora_name": "sql", "lora_path": "/a"}
        )
        assert r.status == 400 and r.json()["error"]["type"] == "InvalidUserInput"
        r = await call(
            app, "POST", "/v1/load_lora_adapter", {"lora_name": "tiny-llama", "lora_path": "/a"}
        )
        assert r.status == 400
        models = (await call(app, "GET", "/v1/models")).json()["data"]
        assert [(m["id"], m["parent"], m["root"]) for m in models] == [
            ("tiny-llama", None, "var/tiny-llama"),
            ("sql", "tiny-llama", "/a/sql"),
        ]
        r = await call(
            app,
            "POST",
            CHAT,
            {"model": "sql", "messages": [{"role": "user", "content": "q"}], "max_tokens": 2},
        )
        assert r.status == 200 and r.json()["model"] == "sql"
        text = engine.metrics_text().decode()
        assert 'vllm:lora_requests_info{max_lora="4"' in text
        r = await call(app, "POST", "/v1/unload_lora_adapter", {"lora_name": "sql"})
        assert r.status == 200
        r = await call(app, "POST", "/v1/unload_lora_adapter", {"lora_name": "sql"})
        assert r.status == 404 and r.json()["error"]["type"] == "NotFoundError"
        r = await call(
            app, "POST", CHAT, {"model": "sql", "messages": [{"role": "user", "content": "q"}]}
        )
        assert r.status == 404

    with_engine(check, lora_modules=())


def test_zero_latency_answers_at_once_with_the_same_bodies() -> None:
    async def check(app: EngineApp, engine: SimEngine) -> None:
        body = {
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4,
            "ignore_eos": True,
        }
        t0 = asyncio.get_running_loop().time()
        full = await call(app, "POST", CHAT, body)
        events = (
            await call(
                app,
                "POST",
                CHAT,
                {**body, "stream": True, "stream_options": {"include_usage": True}},
            )
        ).events()
        assert asyncio.get_running_loop().time() - t0 < 0.05
        assert full.json()["usage"]["completion_tokens"] == 4
        assert (
            "".join(e["choices"][0]["delta"]["content"] for e in events[:-2])
            == full.json()["choices"][0]["message"]["content"]
        )
        assert parse_vllm_metrics(engine.metrics_text().decode()).generation_tokens_total == 8

    with_engine(check, zero_latency=True)


def test_next_turn_hits_the_previous_prompt_and_answer() -> None:
    async def check(app: EngineApp, engine: SimEngine) -> None:
        turns = [
            {"role": "system", "content": "You answer questions about invoices. " * 8},
            {"role": "user", "content": "Why was I charged twice in March?"},
        ]
        first = (await call(app, "POST", CHAT, {"messages": turns, "max_tokens": 200})).json()
        assert first["choices"][0]["finish_reason"] == "stop"  # ended by itself, with EOS
        answer = first["choices"][0]["message"]["content"]
        turns += [
            {"role": "assistant", "content": answer},
            {"role": "user", "content": "And in April?"},
        ]
        second = (await call(app, "POST", CHAT, {"messages": turns, "max_tokens": 5})).json()
        computed = first["usage"]["prompt_tokens"] + first["usage"]["completion_tokens"] - 1
        cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached == computed // 16 * 16 > first["usage"]["prompt_tokens"]

    with_engine(check, output_len_median=40)


def test_continuous_usage_on_every_chunk_including_the_role_chunk() -> None:
    async def check(app: EngineApp, engine: SimEngine) -> None:
        body = {
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 3,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        }
        events = (await call(app, "POST", CHAT, body)).events()
        usages = [e["usage"] for e in events[:-1]]
        assert [u["completion_tokens"] for u in usages] == [0, 1, 2, 3, 3]
        assert usages[0]["completion_tokens_details"] is None
        keys = ["id", "object", "created", "model", "choices", "usage"]
        assert list(events[0]) == [*keys, "prompt_token_ids", "prompt_text"]

    with_engine(check)
