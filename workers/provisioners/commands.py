"""The command lines of engines, rendered from an :class:`EngineSpec`. Pure.

:func:`vllm_args` is vLLM's OpenAI server's flags (the same for a local process and a
Kubernetes container); :func:`sim_args` is the simulator's (``fedinfer engine-sim``), which takes
the subset of them it models.
"""

from __future__ import annotations

import json
from typing import Any

from federation.fleet.spec import EngineSpec, ProvisionerError
from federation.inventory import engine_flags
from regions.engines.accelerators import ACCELERATORS
from regions.engines.block_hash import HASH_ALGO

#: vLLM accepts only these LoRA ranks for --max-lora-rank.
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
#: Flags the renderer sets itself: engine_args may not set them a second time.
RENDERED_FLAGS = frozenset(
    {
        "model",
        "served-model-name",
        "host",
        "port",
        "tensor-parallel-size",
        "gpu-memory-utilization",
        "max-model-len",
        "enable-lora",
        "lora-modules",
        "max-lora-rank",
        "kv-events-config",
        "enable-prefix-caching",
        "prefix-caching-hash-algo",
        "enable-prompt-tokens-details",
    }
)
DISAGGREGATED_ROLES = frozenset({"prefill", "decode"})
#: A prefill or decode engine moves KV blocks with vLLM's NIXL connector, which plays both
#: sides (ADR 0007: the edge hands ``kv_transfer_params`` from one to the other); a deployment
#: with another connector gives its own ``kv-transfer-config`` in engine_args.
PD_KV_TRANSFER_CONFIG = json.dumps({"kv_connector": "NixlConnector", "kv_role": "kv_both"})


def _lora_rank(rank: int) -> int:
    for allowed in VLLM_LORA_RANKS:
        if rank <= allowed:
            return allowed
    raise ProvisionerError(f"LoRA rank {rank} is above vLLM's largest ({VLLM_LORA_RANKS[-1]}).")


def _extra_flags(engine_args: dict[str, Any]) -> list[str]:
    """The deployment's own flags, rendered only from the allowlist the API checks
    (:func:`federation.inventory.engine_flags.render`): a row that predates it, or was
    written around the API, starts nothing it would refuse."""
    for key in sorted(engine_args, key=str):
        if key in RENDERED_FLAGS:
            raise ProvisionerError(
                f"engine_args may not set --{key}: it is rendered from the deployment."
            )
    try:
        return engine_flags.render(engine_args)
    except ValueError as exc:
        raise ProvisionerError(f"engine_args refused: {exc}") from exc


def kv_events_config(port: int, host: str) -> str:
    """vLLM's ``--kv-events-config``: KV-cache events on ZMQ, which the edges subscribe to,
    bound on the engine's own IPv4 ``host`` only (not every interface). Written
    ``tcp://[::ffff:HOST]:PORT``: vLLM binds an endpoint containing ``*`` or ``::`` and
    connects to any other, and libzmq binds an IPv4-mapped address as the IPv4 one."""
    return json.dumps(
        {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://[::ffff:{host}]:{port}",
            "topic": "kv-events",
        }
    )


def vllm_args(
    spec: EngineSpec, *, host: str, port: int, events_host: str | None = None
) -> list[str]:
    """The flags of ``python -m vllm.entrypoints.openai.api_server`` for ``spec``; its KV
    events bound on ``events_host`` (default ``host``)."""
    args = [
        "--model",
        spec.model,
        "--served-model-name",
        spec.served_model_name,
        "--host",
        host,
        "--port",
        str(port),
        "--tensor-parallel-size",
        str(spec.tensor_parallel_size),
        "--gpu-memory-utilization",
        f"{spec.gpu_memory_utilization:g}",
        # The edge routes on prefix-cache hits and meters cached tokens from the usage's
        # prompt_tokens_details (as platform/k8s/region/vllm.yaml and tests/vllm run it).
        "--enable-prefix-caching",
        # Block hashes every edge can compute from the prompt's tokens (sha256 of canonical
        # CBOR; the default pickles): exact prefix matching against the KV events
        # (regions/engines/block_hash.py).
        "--prefix-caching-hash-algo",
        HASH_ALGO,
        "--enable-prompt-tokens-details",
    ]
    if spec.max_model_len is not None:
        args += ["--max-model-len", str(spec.max_model_len)]
    if spec.adapters:
        args += ["--enable-lora", "--lora-modules"]
        args += [f"{a.name}={a.source}" for a in spec.adapters]
        args += ["--max-lora-rank", str(_lora_rank(max(a.rank for a in spec.adapters)))]
    if spec.kv_events_port is not None:
        args += ["--kv-events-config", kv_events_config(spec.kv_events_port, events_host or host)]
    if spec.role in DISAGGREGATED_ROLES and "kv-transfer-config" not in spec.engine_args:
        args += ["--kv-transfer-config", PD_KV_TRANSFER_CONFIG]
    return args + _extra_flags(spec.engine_args)


def sim_args(spec: EngineSpec, *, host: str, port: int) -> list[str]:
    """The flags of ``fedinfer engine-sim`` for ``spec``: one engine, the same model name,
    TP, accelerator (when the simulator models it), context and adapters."""
    args = ["--host", host, "--port", str(port), "--model", spec.served_model_name]
    args += ["--tp", str(spec.tensor_parallel_size), "--prefix-caching-hash-algo", HASH_ALGO]
    if spec.accelerator in ACCELERATORS:
        args += ["--accelerator", spec.accelerator]
    if spec.max_model_len is not None:
        args += ["--max-model-len", str(spec.max_model_len)]
    if spec.adapters:
        args += ["--lora-modules", *(f"{a.name}={a.source}" for a in spec.adapters)]
    seqs = spec.engine_args.get("max-num-seqs")
    if isinstance(seqs, int) and not isinstance(seqs, bool):
        # The requests it runs at once: what the table's per-instance cap and the autoscaler's
        # utilisation are measured against.
        args += ["--max-num-seqs", str(seqs)]
    return args
