"""The local provisioner: engines as processes on the worker's machine — ``fedinfer
engine-sim`` (the embedded default, the demo's and the tests') or real vLLM.

Each engine leads its own session, so it outlives the worker that started it; it carries its
name, URL and this provisioner's folder in its environment. The listing reads them back from
``/proc``: it is the operating system's truth, so a worker killed at any point — even between
spawning an engine and recording anything — finds on restart exactly what runs, adopts it, and
starts no duplicate. Logs are ``<engines dir>/<name>.log``. One machine: a second worker on
another machine cannot see these engines (use the Kubernetes provisioner there).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from urllib.parse import urlsplit

from federation.fleet.spec import EngineSpec, ProvisionerError, Running
from regions.supervisor import LOOPBACK, free_port, start_process
from workers.provisioners.commands import sim_args, vllm_args

ENV_NAME = "FEDINFER_ENGINE_NAME"
ENV_URL = "FEDINFER_ENGINE_URL"
ENV_OWNER = "FEDINFER_ENGINES_DIR"
#: Seconds between SIGTERM and SIGKILL of an engine's process group.
STOP_GRACE_S = 10.0
#: What of the worker's environment an engine gets: how to run (paths, locale, time zone),
#: its GPUs (CUDA, NVIDIA, NCCL, torch, Triton), vLLM's and Hugging Face's own settings (the
#: model cache, offline mode, the token its weights download with) and the network's proxies.
#: Never the rest: the worker's environment holds the control plane's secrets
#: (FEDINFER_SECRET_KEY, DATABASE_URL, REDIS_URL, FEDINFER_TABLE_KEYS...), and an engine runs
#: model code (docs/operations.md, "Engine flags and environment").
ENGINE_ENV_NAMES = frozenset(
    {
        "PATH",
        "HOME",
        "USER",
        "LOGNAME",
        "LANG",
        "LANGUAGE",
        "TZ",
        "TMPDIR",
        "PYTHONPATH",
        "PYTHONHASHSEED",  # the simulator's block-hash seed, as vLLM's
        "LD_LIBRARY_PATH",
        "XDG_CACHE_HOME",
        "OMP_NUM_THREADS",
        "TRANSFORMERS_OFFLINE",
        "TRANSFORMERS_CACHE",
        "SSL_CERT_FILE",
        "SSL_CERT_DIR",
        "REQUESTS_CA_BUNDLE",
        "HTTP_PROXY",
        "HTTPS_PROXY",
        "NO_PROXY",
        "http_proxy",
        "https_proxy",
        "no_proxy",
    }
)
ENGINE_ENV_PREFIXES = ("LC_", "CUDA_", "NVIDIA_", "NCCL_", "TORCH_", "TRITON_", "VLLM_", "HF_")


class LocalProvisioner:
    kind = "local"

    def __init__(self, engines_dir: Path, *, engine: str = "sim", vllm_python: str = "") -> None:
        if engine not in ("sim", "vllm"):
            raise ValueError(f"engine must be 'sim' or 'vllm', not {engine!r}")
        self.engines_dir = engines_dir.resolve()
        self.engine = engine
        self.vllm_python = vllm_python

    def endpoint_for(self, name: str) -> str:
        return f"http://{LOOPBACK}:{free_port()}"

    def argv(self, spec: EngineSpec) -> list[str]:
        port = urlsplit(spec.url).port
        if port is None:
            raise ProvisionerError(f"{spec.url} names no port")
        if self.engine == "sim":
            fedinfer = str(Path(sys.executable).with_name("fedinfer"))
            return [fedinfer, "engine-sim", *sim_args(spec, host=LOOPBACK, port=port)]
        module = "vllm.entrypoints.openai.api_server"
        return [self.vllm_python, "-m", module, *vllm_args(spec, host=LOOPBACK, port=port)]

    def start(self, spec: EngineSpec) -> Running:
        found = self.running().get(spec.name)
        if found is not None:
            return found
        argv = self.argv(spec)
        env = {
            **engine_environment(os.environ),
            # Adapters are loaded where their demand appears (federation/fleet/adapters.py).
            "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",
            ENV_NAME: spec.name,
            ENV_URL: spec.url,
            ENV_OWNER: str(self.engines_dir),
        }
        try:
            process = start_process(
                spec.name, argv, log=self.engines_dir / f"{spec.name}.log", append=True, env=env
            )
        except OSError as exc:
            raise ProvisionerError(f"cannot start {argv[0]}: {exc}") from exc
        return Running(spec.name, spec.url, {"pid": process.pid})

    def stop(self, name: str) -> None:
        running = self.running().get(name)
        if running is None:
            return
        pid = int(running.detail["pid"])
        _signal_group(pid, signal.SIGTERM)
        _signal_group(pid, signal.SIGCONT)  # a stopped (hung) engine gets the SIGTERM too
        deadline = time.monotonic() + STOP_GRACE_S
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        # The whole group: what the engine spawned goes with it (vLLM's engine core).
        _signal_group(pid, signal.SIGKILL)
        _reap(pid)

    def is_running(self, name: str) -> bool:
        return name in self.running()

    def running(self) -> dict[str, Running]:
        found: dict[str, Running] = {}
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            pid = int(entry.name)
            stat = _stat(pid)
            if not stat or stat[0] == "Z":
                _reap(pid)  # an engine of ours that exited: collect it, it runs no more
                continue
            env = _environ(pid)
            if env.get(ENV_OWNER) != str(self.engines_dir) or ENV_NAME not in env:
                continue
            if int(stat[3]) != pid:
                continue  # a child of an engine (same environment), not the engine itself
            found[env[ENV_NAME]] = Running(env[ENV_NAME], env.get(ENV_URL, ""), {"pid": pid})
        return found


def engine_environment(worker_env: Mapping[str, str]) -> dict[str, str]:
    """The part of the worker's environment an engine may see: the allowlisted names and
    prefixes above, nothing else."""
    return {
        name: value
        for name, value in worker_env.items()
        if name in ENGINE_ENV_NAMES or name.startswith(ENGINE_ENV_PREFIXES)
    }


def _environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    pairs = (item.partition(b"=") for item in raw.split(b"\0") if item)
    return {k.decode(errors="replace"): v.decode(errors="replace") for k, _, v in pairs}


def _stat(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return []


def _alive(pid: int) -> bool:
    _reap(pid)
    stat = _stat(pid)
    return bool(stat) and stat[0] != "Z"


def _reap(pid: int) -> None:
    """Collect the exit status when the engine is our child (started by this worker)."""
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pid, os.WNOHANG)


def _signal_group(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)
