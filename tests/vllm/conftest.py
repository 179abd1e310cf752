"""Fixtures of ``make test-vllm``: the tiny model, two real vLLM servers, the edge before them.

Every process is started by :mod:`regions.supervisor` in its own process group and killed with
it at teardown.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.vllm.servers import (
    EDGE_REGION,
    POOLING_ARGS,
    ROOT,
    EdgeProcess,
    VllmServer,
    routing_table,
    start_edge,
    start_server,
    tiny_model_dir,
    vllm_python,
    wait_healthy,
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests that kill one of the session's servers run after all the others."""
    items.sort(key=lambda item: item.get_closest_marker("kills_servers") is not None)


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    model_dir = tiny_model_dir()
    subprocess.run(
        [str(vllm_python()), str(Path(__file__).with_name("build_tiny_model.py")), str(model_dir)],
        check=True,
        timeout=300,
        cwd=ROOT,
    )
    return model_dir


@dataclass
class VllmServers:
    """The session's servers: two generating ones, and one ``--runner pooling`` (embeddings,
    score, rerank) serving :data:`POOLING_MODEL`."""

    pair: tuple[VllmServer, VllmServer]
    pooling: VllmServer


@pytest.fixture(scope="session")
def vllm_servers(tiny_model: Path) -> Iterator[VllmServers]:
    """Every server of the session, started together and waited for together (three took
    224 s on this 2-core machine, two 177 s; one started after the others adds its whole
    start, ~2 min)."""
    if not vllm_python().exists():
        raise FileNotFoundError(f"{vllm_python()} is missing: run `make vllm-env`")
    cpus = sorted(os.sched_getaffinity(0))
    servers = [
        start_server("vllm-a", tiny_model, cpus[0]),
        start_server("vllm-b", tiny_model, cpus[-1]),
        start_server("vllm-pool", tiny_model, cpus[0], POOLING_ARGS),
    ]
    try:
        wait_healthy(servers)
        for server in servers:
            print(f"{server.name} healthy after {server.healthy_after_s:.1f} s", file=sys.stderr)
        yield VllmServers((servers[0], servers[1]), servers[2])
    finally:
        for server in servers:
            server.stop()


@pytest.fixture(scope="session")
def vllm_pair(vllm_servers: VllmServers) -> tuple[VllmServer, VllmServer]:
    """Two real vLLM servers, one core each."""
    return vllm_servers.pair


@pytest.fixture(scope="session")
def vllm_pooling(vllm_servers: VllmServers) -> VllmServer:
    """A real vLLM server with ``--runner pooling`` (the tiny model as an embedding model)."""
    return vllm_servers.pooling


@pytest.fixture(scope="session")
def edge(
    vllm_pair: tuple[VllmServer, VllmServer], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[EdgeProcess]:
    """``fedinfer edge`` (the project venv's) in front of the two real servers."""
    table_path = tmp_path_factory.mktemp("edge") / "table.json"
    table_path.write_text(json.dumps(routing_table(vllm_pair), indent=2))
    # A busy CPU server on a shared core can take seconds to answer /metrics and /health: a late
    # reading that says "busy" is what the load-steering test needs, and a slow /health is not
    # a dead server (on GPUs both answer in milliseconds; the defaults are 2 s and 1 s).
    timeouts = ("--scrape-timeout", "10", "--probe-timeout", "10")
    edge_proc = start_edge(
        "edge", table_path, "--region", EDGE_REGION, *timeouts, healthy_instances=2
    )
    try:
        yield edge_proc
    finally:
        edge_proc.stop()
