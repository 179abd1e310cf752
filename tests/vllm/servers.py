"""Real vLLM (CPU build) servers and the edge on loopback, for ``make test-vllm``.

The tests run in the project venv; vLLM runs as a subprocess from its own venv
(``FEDINFER_VLLM_PYTHON``, default ``.venv-vllm/bin/python``) on the tiny local model
(``FEDINFER_TINY_MODEL``, default ``var/tiny-llama``, built by ``make vllm-env``). Every server is
started in its own process group and killed with it at teardown.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

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


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


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
        "--enable-prompt-tokens-details",
    ]


def server_env(cpu: int) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        VLLM_CPU_KVCACHE_SPACE="1",  # GiB of KV cache
        VLLM_CPU_OMP_THREADS_BIND=str(cpu),  # one core each, so two servers fit on 2 cores
        OMP_NUM_THREADS="1",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
    )
    return env


@dataclass
class VllmServer:
    name: str
    port: int
    log_path: Path
    proc: subprocess.Popen[bytes]
    started_at: float = field(default_factory=time.monotonic)
    healthy_after_s: float | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_tail(self, lines: int = 40) -> str:
        text = self.log_path.read_text(errors="replace")
        return "\n".join(text.splitlines()[-lines:])

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)
        # vLLM's engine core and workers are children in the same group: make sure none is left.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)


def start_server(name: str, model_dir: Path, cpu: int) -> VllmServer:
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    port = free_port()
    log_path = LOG_DIR / f"{name}.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            server_argv(model_dir, port),
            cwd=ROOT,
            env=server_env(cpu),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    return VllmServer(name=name, port=port, log_path=log_path, proc=proc)


def wait_healthy(servers: list[VllmServer], timeout_s: float = HEALTH_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    pending = list(servers)
    with httpx.Client(timeout=2.0) as client:
        while pending:
            for server in list(pending):
                code = server.proc.poll()
                if code is not None:
                    raise RuntimeError(
                        f"vLLM server {server.name} exited with {code} before it was healthy:\n"
                        + server.log_tail()
                    )
                try:
                    ok = client.get(server.base_url + "/health").status_code == 200
                except httpx.TransportError:
                    ok = False
                if ok:
                    server.healthy_after_s = time.monotonic() - server.started_at
                    pending.remove(server)
            if pending and time.monotonic() > deadline:
                names = [s.name for s in pending]
                raise TimeoutError(
                    f"vLLM servers {names} not healthy after {timeout_s:.0f} s:\n"
                    + "\n".join(s.log_tail() for s in pending)
                )
            if pending:
                time.sleep(1.0)


@dataclass
class EdgeProcess:
    port: int
    table_path: Path
    log_path: Path
    proc: subprocess.Popen[bytes]
    #: The operator listener (``--operator-port``: /healthz, /metrics).
    ops_port: int = 0

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def ops_url(self) -> str:
        return f"http://127.0.0.1:{self.ops_port}"

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=15)


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
