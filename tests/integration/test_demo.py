"""``fedinfer demo`` runs the platform for real: control plane, engines, one edge per region."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
def demo(tmp_path: Path):
    web_port = _free_port()
    env = {**os.environ, "FEDINFER_VAR_DIR": str(tmp_path), "FEDINFER_MODE": "embedded"}
    # The demo's embedded defaults (SQLite under var/), not the test settings.
    env.pop("DATABASE_URL", None)
    env.pop("DJANGO_SETTINGS_MODULE", None)
    log = (tmp_path / "demo.log").open("wb")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "federation.cli",
            "demo",
            "--port",
            str(web_port),
            "--edge-base-port",
            "0",  # free ports from the OS: fixed ones may be taken on a busy test machine
            "--exit-after",
            "60",
        ],
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    endpoints = tmp_path / "demo" / "endpoints.json"
    deadline = time.monotonic() + 90
    while not endpoints.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            out = (tmp_path / "demo.log").read_text()
            pytest.fail(f"demo did not start (code {proc.poll()}):\n{out[-3000:]}")
        time.sleep(0.2)
    try:
        yield proc, json.loads(endpoints.read_text())
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            raise


def test_demo_serves_a_request_in_every_region_and_stops_cleanly(demo) -> None:
    proc, endpoints = demo
    assert set(endpoints["edges"]) == {"us-east", "eu-west", "ap-southeast"}
    assert len(endpoints["instances"]) == 10
    assert set(endpoints["api_keys"]) == {"acme-us", "globex-eu", "umbrella-sg", "initech"}
    key = endpoints["api_keys"]["initech"]  # the tenant allowed everywhere
    assert key.startswith("fi_")
    for region, edge_url in endpoints["edges"].items():
        client = openai.OpenAI(base_url=f"{edge_url}/v1", api_key=key, max_retries=0)
        raw = client.chat.completions.with_raw_response.create(
            model="meta-llama/Llama-3.1-8B-Instruct",
            messages=[{"role": "user", "content": f"Hello from the {region} test"}],
            max_tokens=8,
        )
        completion = raw.parse()
        assert completion.choices[0].message.content
        route = raw.headers["x-fedinfer-route"]
        assert f"region={region}" in route
        assert f"instance=demo-{region}" in route
    api = httpx.get(f"{endpoints['control_plane']}/api/v1/regions/", timeout=5)
    assert api.status_code in (401, 403)  # the API wants credentials
    os.killpg(proc.pid, signal.SIGINT)
    assert proc.wait(timeout=30) == 0
    for _name, url in endpoints["instances"]:
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"{url}/health", timeout=1)
