"""Faults through the edge: an engine killed mid-run, client disconnects, a saturated region."""

from __future__ import annotations

import json
import re
import signal
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from tests.integration.test_edge_support import cluster, route_of


def sdk(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=15)


def test_engine_killed_mid_run(tmp_path: Path) -> None:
    """With continuation off, a cut stream ends with an error event; nothing new reaches the
    dead one. (Continued streams: ``test_edge_continuation.py``.)"""
    with cluster(
        tmp_path,
        3,
        engine_args=("--tokens", "30", "--token-delay", "0.05"),
        edge_args=("--eject-after", "2", "--probe-interval", "0.2", "--max-continuations", "0"),
    ) as edge:
        c = sdk(edge.url)
        raw = c.chat.completions.with_raw_response.create(
            model="llama", messages=[{"role": "user", "content": "a long story"}], stream=True
        )
        victim = route_of(raw.headers)["instance"]
        stream = raw.parse()
        first = next(iter(stream))
        assert first.choices[0].delta.content == f"{victim}:"

        def ask(k: int) -> tuple[int, str, str]:
            r = httpx.post(
                edge.url + "/v1/chat/completions",
                json={
                    "model": "llama",
                    "messages": [{"role": "user", "content": f"independent {k}"}],
                    "max_tokens": 1,
                },
                timeout=15,
            )
            return r.status_code, route_of(r.headers).get("instance", ""), r.text

        with ThreadPoolExecutor(8) as pool:
            during = [pool.submit(ask, k) for k in range(12)]
            time.sleep(0.05)
            edge.engines[victim].proc.send_signal(signal.SIGKILL)
            edge.engines[victim].proc.wait(timeout=5)
            results = [f.result() for f in during]

        # Requests not yet answered when the engine died were retried elsewhere and succeeded.
        assert [s for s, _, _ in results] == [200] * len(results), results

        # The cut stream ends with a clear error event, which the SDK raises.
        with pytest.raises(openai.APIError, match="mid-stream"):
            for _ in stream:
                pass

        # After the ejection threshold, no new request goes to the dead instance.
        time.sleep(0.5)
        after = [ask(k) for k in range(100, 112)]
        assert all(s == 200 for s, _, _ in after)
        assert victim not in {inst for _, inst, _ in after}
        health = httpx.get(edge.ops + "/healthz").json()
        assert health["healthy_instances"] == 2
        metrics = httpx.get(edge.ops + "/metrics").text
        assert f'fedinfer_edge_ejections_total{{instance="{victim}"}} 1.0' in metrics
        assert f'fedinfer_edge_midstream_failures_total{{instance="{victim}"}} 1.0' in metrics
        assert f'fedinfer_edge_scrape_failures_total{{instance="{victim}"}}' in metrics


def test_cut_stream_error_event_on_the_wire(tmp_path: Path) -> None:
    """Byte level: the chunks that arrived, then ``data: {"error": ...}``, then the end."""
    with cluster(tmp_path, 1, engine_args=("--tokens", "40", "--token-delay", "0.05")) as edge:
        body = {"model": "llama", "messages": [{"role": "user", "content": "x"}], "stream": True}
        with httpx.stream("POST", edge.url + "/v1/chat/completions", json=body, timeout=10) as r:
            assert r.status_code == 200
            it = r.iter_raw()
            got = next(it)
            edge.engines["i-1"].proc.send_signal(signal.SIGKILL)
            got += b"".join(it)
        events = got.split(b"\n\n")
        assert events[-1] == b""
        assert events[0].startswith(b'data: {"id"')
        assert re.match(rb'data: \{"error":\{"message":"the engine failed mid-stream', events[-2])
        assert b"i-1" not in events[-2]  # which instance failed is the operator's business
        assert b"[DONE]" not in got


def test_client_disconnect_closes_the_upstream(tmp_path: Path) -> None:
    with cluster(tmp_path, 1, engine_args=("--tokens", "60", "--token-delay", "0.05")) as edge:
        body = {"model": "llama", "messages": [{"role": "user", "content": "x"}], "stream": True}
        with httpx.stream("POST", edge.url + "/v1/chat/completions", json=body, timeout=10) as r:
            next(r.iter_raw())
        engine = edge.engines["i-1"]
        deadline = time.monotonic() + 3
        while engine.stats()["aborted"] != 1:
            assert time.monotonic() < deadline, "the engine never saw the request aborted"
            time.sleep(0.05)
        assert engine.stats()["running"] == 0
        time.sleep(0.3)
        metrics = httpx.get(edge.ops + "/metrics").text
        assert 'fedinfer_edge_inflight{instance="i-1"} 0.0' in metrics


def test_saturated_region_queues_then_refuses_with_retry_after(tmp_path: Path) -> None:
    with cluster(
        tmp_path,
        1,
        engine_args=("--tokens", "3", "--token-delay", "0.2"),
        edge_args=("--queue-size", "1", "--queue-timeout", "2"),
        max_concurrency=1,
    ) as edge:

        def ask(k: int) -> httpx.Response:
            return httpx.post(
                edge.url + "/v1/chat/completions",
                json={"model": "llama", "messages": [{"role": "user", "content": f"q{k}"}]},
                timeout=10,
            )

        with ThreadPoolExecutor(3) as pool:
            responses = list(pool.map(ask, range(3)))
        statuses = sorted(r.status_code for r in responses)
        assert statuses == [200, 200, 503]
        refused = next(r for r in responses if r.status_code == 503)
        assert refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["code"] == "saturated"
        queued = [
            float(re.search(r"queue;dur=([\d.]+)", r.headers["server-timing"]).group(1))  # type: ignore[union-attr]
            for r in responses
            if r.status_code == 200
        ]
        assert max(queued) > 300, "the second request waited at the gateway for the slot"


def test_gateway_queue_is_first_in_first_out(tmp_path: Path) -> None:
    with cluster(
        tmp_path,
        1,
        engine_args=("--tokens", "2", "--token-delay", "0.1"),
        edge_args=("--queue-size", "16", "--queue-timeout", "20"),
        max_concurrency=1,
    ) as edge:
        engine = edge.engines["i-1"]

        def ask(k: int) -> int:
            r = httpx.post(
                edge.url + "/v1/chat/completions",
                json={"model": "llama", "messages": [{"role": "user", "content": f"fifo-q{k}"}]},
                timeout=30,
            )
            return r.status_code

        with ThreadPoolExecutor(6) as pool:
            futures = []
            for k in range(6):
                futures.append(pool.submit(ask, k))
                # Send the next one only once this one is in line (or already at the engine),
                # so the arrival order is known whatever the machine's load.
                deadline = time.monotonic() + 10
                while True:
                    queued = httpx.get(edge.ops + "/healthz").json()["queue_depth"]
                    if queued + len(engine.stats()["prompts"]) >= k + 1:
                        break
                    assert time.monotonic() < deadline, f"q{k} never arrived"
                    time.sleep(0.01)
            assert [f.result() for f in futures] == [200] * 6
        order = [p.split("fifo-")[1].strip() for p in engine.stats()["prompts"]]
        assert order == [f"q{k}" for k in range(6)]


def test_a_client_that_stops_reading_a_stream_frees_its_slot(tmp_path: Path) -> None:
    """A stream nobody reads fills the socket buffers; at the write timeout the edge drops the
    client, the engine sees the request aborted, the slot is free again, and the instance —
    which did nothing wrong — stays admitted. Other clients are served meanwhile."""
    with cluster(tmp_path, 1, edge_args=("--write-timeout", "1", "--max-retries", "0")) as edge:
        (engine,) = edge.engines.values()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", edge.port))
        body = json.dumps(
            {
                "model": "llama",
                "messages": [{"role": "user", "content": "never read"}],
                "stream": True,
                "max_tokens": 200_000,
            }
        ).encode()
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: edge\r\n"
            b"content-type: application/json\r\ncontent-length: %d\r\n\r\n%b" % (len(body), body)
        )
        try:
            deadline = time.monotonic() + 30
            while engine.stats()["aborted"] != 1:
                assert time.monotonic() < deadline, "the unread stream was never aborted"
                # Meanwhile the edge keeps serving everyone else.
                ok = httpx.post(
                    edge.url + "/v1/chat/completions",
                    json={"model": "llama", "messages": [{"role": "user", "content": "hi"}]},
                    timeout=10,
                )
                assert ok.status_code == 200, ok.text
                time.sleep(0.2)
        finally:
            sock.close()
        health = httpx.get(edge.ops + "/healthz").json()["detail"][engine.name]
        assert health["healthy"] and health["inflight"] == 0, health
        metrics = httpx.get(edge.ops + "/metrics").text
        assert 'fedinfer_edge_http_refusals_total{reason="write_timeout"} 1.0' in metrics
        assert "fedinfer_edge_ejections_total{" not in metrics


def test_error_bodies_name_no_instance_and_no_internal_error(tmp_path: Path) -> None:
    """502/503 bodies reach tenants: what failed inside the region stays in the edge's log."""
    with cluster(tmp_path, 1, edge_args=("--max-retries", "0", "--eject-after", "100")) as edge:
        (engine,) = edge.engines.values()
        engine.proc.send_signal(signal.SIGKILL)
        engine.proc.wait(timeout=10)
        answers = [
            httpx.post(
                edge.url + "/v1/chat/completions",
                json={"model": "llama", "messages": [{"role": "user", "content": "hi"}]},
                timeout=10,
            )
            for _ in range(2)
        ]
        assert {a.status_code for a in answers} <= {502, 503}, [a.text for a in answers]
        for answer in answers:
            text = answer.text
            assert engine.name not in text and str(engine.port) not in text, text
            assert "Error" not in answer.json()["error"]["message"], text


def test_a_read_timeout_is_never_resent_to_another_engine(tmp_path: Path) -> None:
    """A slow engine may still be generating: the edge answers 502 at its read timeout instead
    of running the request a second time elsewhere (a retry storm on an overloaded fleet).
    The time to that 502 is bounded by the read timeout (docs/security.md)."""
    with cluster(
        tmp_path,
        2,
        engine_args=("--tokens", "40", "--token-delay", "0.1"),  # 4 s per answer
        edge_args=("--read-timeout", "1", "--max-retries", "2"),
    ) as edge:
        started = time.monotonic()
        answer = httpx.post(
            edge.url + "/v1/chat/completions",
            json={"model": "llama", "messages": [{"role": "user", "content": "slow"}]},
            timeout=30,
        )
        elapsed = time.monotonic() - started
        assert answer.status_code == 502, answer.text
        assert route_of(answer.headers)["retries"] == "0"
        assert elapsed < 3.0, elapsed
        requests = [e.stats()["requests"] for e in edge.engines.values()]
        assert sorted(requests) == [0, 1], requests


def test_an_engine_that_drops_the_connection_is_retried_elsewhere(tmp_path: Path) -> None:
    """A dead engine runs nothing: its requests not yet answered go to another one."""
    with cluster(
        tmp_path,
        2,
        engine_args=("--tokens", "20", "--token-delay", "0.1"),
        edge_args=("--max-retries", "2", "--eject-after", "100"),
    ) as edge:
        with ThreadPoolExecutor(4) as pool:
            futures = [
                pool.submit(
                    httpx.post,
                    edge.url + "/v1/chat/completions",
                    json={"model": "llama", "messages": [{"role": "user", "content": f"q{k}"}]},
                    timeout=30,
                )
                for k in range(4)
            ]
            time.sleep(0.5)
            edge.engines["i-1"].proc.send_signal(signal.SIGKILL)
            answers = [f.result() for f in futures]
        assert [a.status_code for a in answers] == [200] * 4, [a.text for a in answers]
        assert {route_of(a.headers)["instance"] for a in answers} == {"i-2"}
