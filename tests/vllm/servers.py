"""Real vLLM (CPU build) servers and the edge on loopback, for ``make test-vllm``.

The tests run in the project venv; vLLM runs as a subprocess from its own venv
(``FEDINFER_VLLM_PYTHON``, default ``.venv-vllm/bin/python``) on the tiny local model
(``FEDINFER_TINY_MODEL``, default ``var/tiny-llama``, built by ``make vllm-env``). Every server is
started by :mod:`regions.supervisor` in its own process group and killed with it at teardown.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from regions.supervisor import Process, free_port, http_status, start_process, wait_until

ROOT = Path(__file__).resolve().parents[2]
SERVED_MODEL = "tiny-llama"
MAX_MODEL_LEN = 1024
KV_BLOCK_SIZE = 128  # vLLM's block size on the CPU backend
MAX_NUM_SEQS = 8
HEALTH_TIMEOUT_S = float(os.environ.get("FEDINFER_VLLM_HEALTH_TIMEOUT", "420"))
LOG_DIR = ROOT / "var" / "vllm-logs"


def vllm_python() -> Path:
    return Path(os.environ.get("FEDINFER_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))


def tiny_model_dir() -> Path:
    return Path(os.environ.get("FEDINFER_TINY_MODEL", ROOT / "var" / "tiny-llama")).resolve()


def server_argv(model_dir: Path, port: int) -> list[str]:
    """The exact command line (docs/real-vllm.md quotes it)."""
    return [
        str(vllm_python()),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir),
        "--served-model-name",
        SERVED_MODEL,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--max-num-seqs",
        str(MAX_NUM_SEQS),
        "--enable-prefix-caching",
        # the hashes the edge computes from the prompt's tokens (regions/engines/block_hash.py)
        "--prefix-caching-hash-algo",
        "sha256_cbor",
        "--enable-prompt-tokens-details",
    ]


#: The tiny model as an embedding model: vLLM's pooling runner (``/v1/embeddings``, ``/pooling``,
#: ``/score``, ``/rerank``; no generation), under its own name.
POOLING_MODEL = "tiny-llama-embed"
POOLING_ARGS = ("--runner", "pooling", "--served-model-name", POOLING_MODEL)


def server_env(cpu: int) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        VLLM_CPU_KVCACHE_SPACE="1",  # GiB of KV cache
        VLLM_CPU_OMP_THREADS_BIND=str(cpu),  # one core each, so two servers fit on 2 cores
        OMP_NUM_THREADS="1",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
        # /pause and /resume: the load-steering test holds a load still with them
        VLLM_SERVER_DEV_MODE="1",
        DO_NOT_TRACK="1",
    )
    return env


@dataclass
class VllmServer:
    name: str
    port: int
    proc: Process
    started_at: float = field(default_factory=time.monotonic)
    healthy_after_s: float | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        """vLLM's engine core and workers are in its process group: they go with it."""
        self.proc.stop(grace_s=30)


def start_server(
    name: str, model_dir: Path, cpu: int, extra_args: tuple[str, ...] = ()
) -> VllmServer:
    port = free_port()
    argv = [*server_argv(model_dir, port), *extra_args]
    proc = start_process(name, argv, log=LOG_DIR / f"{name}.log", env=server_env(cpu), cwd=ROOT)
    return VllmServer(name=name, port=port, proc=proc)


def wait_healthy(servers: list[VllmServer], timeout_s: float = HEALTH_TIMEOUT_S) -> None:
    """Until every server's /health is 200, noting how long each took."""
    pending = list(servers)

    def all_healthy() -> bool:
        for server in list(pending):
            if http_status(server.base_url + "/health", timeout=2.0) == 200:
                server.healthy_after_s = time.monotonic() - server.started_at
                pending.remove(server)
        return not pending

    wait_until(
        all_healthy,
        what="vLLM servers' /health",
        timeout=timeout_s,
        watch=[s.proc for s in servers],
        interval=1.0,
    )


@dataclass
class EdgeProcess:
    port: int
    table_path: Path
    proc: Process
    #: The operator listener (``--operator-port``: /healthz, /metrics).
    ops_port: int = 0

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def ops_url(self) -> str:
        return f"http://127.0.0.1:{self.ops_port}"

    def stop(self) -> None:
        self.proc.stop(grace_s=15)


def start_edge(name: str, table_path: Path, *args: str, healthy_instances: int) -> EdgeProcess:
    """``fedinfer edge`` (the project venv's) on ``table_path``, waited for until its /healthz
    counts ``healthy_instances``; its log is ``<LOG_DIR>/<name>.log``."""
    port, ops_port = free_port(), free_port()
    argv = [str(Path(sys.executable).with_name("fedinfer")), "edge", "--table", str(table_path)]
    argv += ["--host", "127.0.0.1", "--port", str(port), "--read-timeout", "120"]
    argv += ["--operator-port", str(ops_port), *args]
    proc = start_process(name, argv, log=LOG_DIR / f"{name}.log", cwd=ROOT)
    edge = EdgeProcess(port=port, table_path=table_path, proc=proc, ops_port=ops_port)

    def ready() -> bool:
        try:
            health = httpx.get(edge.ops_url + "/healthz", timeout=2.0)
        except httpx.TransportError:
            return False
        return health.status_code == 200 and health.json()["healthy_instances"] >= healthy_instances

    try:
        wait_until(ready, what=f"{name}'s /healthz", timeout=30, watch=proc, interval=0.2)
    except Exception:
        edge.stop()
        raise
    return edge


EDGE_REGION = "cpu-lab"
#: Measured for the tiny model on this machine: ~4,600 prompt tokens/s end to end
#: (docs/real-vllm.md).
PREFILL_TOKENS_PER_S = 4500.0


def routing_table(servers: tuple[VllmServer, ...]) -> dict[str, object]:
    """A routing-table document (docs/routing-table.md, schema v1) for the real servers."""
    return {
        "schema_version": 1,
        "version": 1,
        "region": EDGE_REGION,
        "generated_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "instances": [
            {
                "id": server.name,
                "url": server.base_url,
                "model": SERVED_MODEL,
                "accelerator": "cpu",
                "tp": 1,
                "max_concurrency": MAX_NUM_SEQS,
                "prefill_tokens_per_s": PREFILL_TOKENS_PER_S,
                "kv_block_tokens": KV_BLOCK_SIZE,
            }
            for server in servers
        ],
    }
