"""Does a deployment fit its pool? Pure rules over plain data, no Django.

Services convert rows to the specs below and turn the returned problems into a 400; the
placement planner and the routing-table compiler reuse the GPU arithmetic. Every rule mirrors
something the real engine or hardware refuses, so a deployment accepted here can start:

* tensor parallelism stays inside one node unless the nodes are linked by RDMA;
* TP > 2 needs NVLink (all-reduce over PCIe makes larger TP groups slower than smaller ones);
* vLLM splits attention heads evenly over the TP ranks;
* vLLM's startup check: one full ``max-model-len`` sequence must fit in the KV cache left
  after the weights, at the pool's ``gpu_memory_utilization``;
* the pool has the GPUs for every desired replica of every deployment on it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from federation.inventory import engine_flags

GIB = 1024**3

# CUDA context, NCCL buffers, activations and CUDA graphs of one engine. vLLM profiles this at
# startup; 1.5 GiB is what a bf16 8-70B model uses at the default max-num-seqs.
RUNTIME_OVERHEAD_GIB = 1.5

# TP groups larger than this need NVLink: over PCIe the all-reduce dominates the step time.
MAX_TP_WITHOUT_NVLINK = 2

# engine_args are checked against the allowlist of vLLM flags in engine_flags.py.


@dataclass(frozen=True, slots=True)
class PoolSpec:
    """What one GPU pool offers."""

    name: str
    accelerator_name: str
    accelerator_memory_gib: float
    gpus_per_node: int
    node_count: int
    interconnect: str  # "nvlink" or "pcie", between the GPUs of one node
    rdma: bool  # nodes linked by RDMA: multi-node TP groups work
    gpu_memory_utilization: float

    @property
    def total_gpus(self) -> int:
        return self.gpus_per_node * self.node_count


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """The shape of a base model, as far as memory and parallelism care."""

    name: str
    weight_size_gib: float
    max_context_tokens: int
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int


@dataclass(frozen=True, slots=True)
class AdapterSpec:
    name: str
    base_model_name: str


@dataclass(frozen=True, slots=True)
class DeploymentSpec:
    """A proposed placement of a model on a pool."""

    tensor_parallel_size: int
    min_replicas: int
    desired_replicas: int
    max_replicas: int
    engine_args: Any = field(default_factory=dict)
    adapters: Sequence[AdapterSpec] = ()


@dataclass(frozen=True, slots=True)
class Problem:
    """One violated constraint: the input field it belongs to and a message with the numbers."""

    field: str
    message: str


@dataclass(frozen=True, slots=True)
class MemoryEstimate:
    """GiB needed on each GPU of one replica, and what the pool offers."""

    weights_gib: float
    kv_cache_gib: float
    runtime_gib: float
    context_tokens: int
    available_gib: float

    @property
    def needed_gib(self) -> float:
        return self.weights_gib + self.kv_cache_gib + self.runtime_gib

    @property
    def fits(self) -> bool:
        return self.needed_gib <= self.available_gib


# --- GPU arithmetic shared with the planner and the table compiler -------------------------


def replica_gpus(tensor_parallel_size: int) -> int:
    """GPUs one replica occupies: one per TP rank (pipeline parallelism is not used)."""
    return tensor_parallel_size


def deployment_gpus(*, tensor_parallel_size: int, desired_replicas: int) -> int:
    """GPUs a deployment claims in its pool at its desired replica count."""
    return replica_gpus(tensor_parallel_size) * desired_replicas


def pool_used_gpus(demands: Iterable[tuple[int, int]]) -> int:
    """GPUs claimed by deployments given as ``(tensor_parallel_size, desired_replicas)``."""
    return sum(deployment_gpus(tensor_parallel_size=tp, desired_replicas=n) for tp, n in demands)


def pool_free_gpus(pool: PoolSpec, demands: Iterable[tuple[int, int]]) -> int:
    """GPUs of the pool no deployment claims (negative when over-committed)."""
    return pool.total_gpus - pool_used_gpus(demands)


def kv_cache_dtype_bytes(engine_args: Mapping[str, Any]) -> int:
    """Bytes per KV element: vLLM's ``auto`` keeps the activation dtype (16-bit) even for
    FP8/INT4 weights; ``--kv-cache-dtype fp8*`` halves it."""
    value = engine_args.get("kv-cache-dtype", "auto")
    return 1 if isinstance(value, str) and value.startswith("fp8") else 2


def kv_cache_bytes_per_token(
    model: ModelSpec, *, tensor_parallel_size: int, dtype_bytes: int = 2
) -> int:
    """K and V for every layer of one token, on one GPU. KV heads are split over the TP ranks
    but never below one per rank (vLLM replicates them when TP > kv heads)."""
    kv_heads_per_gpu = max(1, math.ceil(model.num_kv_heads / tensor_parallel_size))
    return 2 * model.num_layers * kv_heads_per_gpu * model.head_dim * dtype_bytes


def context_tokens(model: ModelSpec, engine_args: Mapping[str, Any]) -> int:
    """The sequence length the engine reserves for: ``max-model-len`` when set and valid."""
    value = engine_args.get("max-model-len")
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return min(value, model.max_context_tokens)
    return model.max_context_tokens


def memory_per_gpu(
    model: ModelSpec,
    pool: PoolSpec,
    *,
    tensor_parallel_size: int,
    engine_args: Mapping[str, Any] | None = None,
) -> MemoryEstimate:
    """vLLM's startup arithmetic: weights/TP + KV cache for one full sequence + runtime."""
    args = engine_args or {}
    tokens = context_tokens(model, args)
    per_token = kv_cache_bytes_per_token(
        model, tensor_parallel_size=tensor_parallel_size, dtype_bytes=kv_cache_dtype_bytes(args)
    )
    return MemoryEstimate(
        weights_gib=model.weight_size_gib / tensor_parallel_size,
        kv_cache_gib=per_token * tokens / GIB,
        runtime_gib=RUNTIME_OVERHEAD_GIB,
        context_tokens=tokens,
        available_gib=pool.accelerator_memory_gib * pool.gpu_memory_utilization,
    )


# --- the rules ------------------------------------------------------------------------------


def check_deployment_fit(
    deployment: DeploymentSpec,
    *,
    model: ModelSpec,
    pool: PoolSpec,
    other_demands: Iterable[tuple[int, int]] = (),
) -> list[Problem]:
    """Every constraint the deployment violates (empty: it fits).

    ``other_demands`` are the ``(tensor_parallel_size, desired_replicas)`` of the pool's other
    deployments, for the capacity rule.
    """
    problems = check_replicas(deployment)
    problems += check_engine_args(deployment.engine_args, model=model)
    problems += check_adapters(deployment.adapters, model=model)
    tp = deployment.tensor_parallel_size
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        problems.append(Problem("tensor_parallel_size", f"must be at least 1, got {tp!r}"))
        return problems
    problems += check_parallelism(tp, model=model, pool=pool)
    args = deployment.engine_args if isinstance(deployment.engine_args, Mapping) else {}
    problems += check_memory(tp, model=model, pool=pool, engine_args=args)
    problems += check_capacity(deployment, pool=pool, other_demands=other_demands)
    return problems


def check_parallelism(tp: int, *, model: ModelSpec, pool: PoolSpec) -> list[Problem]:
    problems: list[Problem] = []
    per_node = pool.gpus_per_node
    if tp > per_node:
        if not pool.rdma:
            problems.append(
                Problem(
                    "tensor_parallel_size",
                    f"tensor_parallel_size {tp} exceeds the {per_node} GPUs per node of pool "
                    f"{pool.name}, and its nodes have no RDMA link for a multi-node group; "
                    f"use at most {per_node} or a pool with RDMA",
                )
            )
        elif tp % per_node:
            problems.append(
                Problem(
                    "tensor_parallel_size",
                    f"a multi-node tensor_parallel_size must be a multiple of the {per_node} "
                    f"GPUs per node of pool {pool.name}; {tp} is not",
                )
            )
        elif tp // per_node > pool.node_count:
            problems.append(
                Problem(
                    "tensor_parallel_size",
                    f"tensor_parallel_size {tp} needs {tp // per_node} nodes of {per_node} GPUs "
                    f"but pool {pool.name} has {pool.node_count}",
                )
            )
    if tp > MAX_TP_WITHOUT_NVLINK and pool.interconnect != "nvlink":
        problems.append(
            Problem(
                "tensor_parallel_size",
                f"tensor_parallel_size {tp} > {MAX_TP_WITHOUT_NVLINK} needs NVLink between GPUs "
                f"but pool {pool.name} has {pool.interconnect}; use at most "
                f"{MAX_TP_WITHOUT_NVLINK} or an NVLink pool",
            )
        )
    heads = model.num_attention_heads
    if heads % tp:
        divisors = [d for d in range(1, min(heads, pool.total_gpus) + 1) if heads % d == 0]
        problems.append(
            Problem(
                "tensor_parallel_size",
                f"num_attention_heads {heads} of {model.name} is not divisible by "
                f"tensor_parallel_size {tp} (vLLM refuses this); use one of "
                f"{', '.join(map(str, divisors[-6:]))}",
            )
        )
    return problems


def check_memory(
    tp: int, *, model: ModelSpec, pool: PoolSpec, engine_args: Mapping[str, Any]
) -> list[Problem]:
    est = memory_per_gpu(model, pool, tensor_parallel_size=tp, engine_args=engine_args)
    if est.fits:
        return []
    return [
        Problem(
            "tensor_parallel_size",
            f"needs {est.needed_gib:.1f} GiB per GPU (weights {est.weights_gib:.1f} + KV cache "
            f"for one {est.context_tokens}-token sequence {est.kv_cache_gib:.1f} + runtime "
            f"{est.runtime_gib:.1f}) but {pool.accelerator_name} at "
            f"{pool.gpu_memory_utilization:.2f} offers {est.available_gib:.1f} GiB; raise "
            f"tensor_parallel_size, lower max-model-len or use a larger GPU",
        )
    ]


def check_capacity(
    deployment: DeploymentSpec, *, pool: PoolSpec, other_demands: Iterable[tuple[int, int]]
) -> list[Problem]:
    if deployment.desired_replicas < 0:
        return []  # reported by check_replicas
    used = pool_used_gpus(other_demands)
    free = pool.total_gpus - used
    tp = deployment.tensor_parallel_size
    wanted = deployment_gpus(tensor_parallel_size=tp, desired_replicas=deployment.desired_replicas)
    if wanted <= free:
        return []
    return [
        Problem(
            "desired_replicas",
            f"needs {wanted} GPUs ({deployment.desired_replicas} replicas x "
            f"tensor_parallel_size {tp}) but pool {pool.name} has {pool.total_gpus} GPUs, "
            f"{used} used by other deployments, {max(free, 0)} free",
        )
    ]


def check_replicas(deployment: DeploymentSpec) -> list[Problem]:
    lo, want, hi = deployment.min_replicas, deployment.desired_replicas, deployment.max_replicas
    problems: list[Problem] = []
    for name, value in (("min_replicas", lo), ("desired_replicas", want), ("max_replicas", hi)):
        if value < 0:
            problems.append(Problem(name, f"{name} must not be negative, got {value}"))
    if problems:
        return problems
    if hi < 1:
        problems.append(Problem("max_replicas", f"max_replicas must be at least 1, got {hi}"))
    if lo > want:
        problems.append(
            Problem("min_replicas", f"min_replicas {lo} exceeds desired_replicas {want}")
        )
    if want > hi:
        problems.append(
            Problem("desired_replicas", f"desired_replicas {want} exceeds max_replicas {hi}")
        )
    return problems


def check_engine_args(engine_args: Any, *, model: ModelSpec) -> list[Problem]:
    """vLLM flags as ``{"max-num-seqs": 256}``: only flags of the allowlist
    (:mod:`~federation.inventory.engine_flags`), each with a value of its type, none the
    platform sets itself; ``max-model-len`` within the model's context. Who may set the
    admin-only flags is the service's check (it knows the actor)."""
    problems = [
        Problem("engine_args", text) for text in engine_flags.engine_args_problems(engine_args)
    ]
    if problems or not isinstance(engine_args, Mapping):
        return problems
    value = engine_args.get("max-model-len")
    if value is not None and not (
        isinstance(value, int)
        and not isinstance(value, bool)
        and 1 <= value <= model.max_context_tokens
    ):
        problems.append(
            Problem(
                "engine_args",
                f"max-model-len must be an integer from 1 to the max_context_tokens "
                f"{model.max_context_tokens} of {model.name}, got {value!r}",
            )
        )
    return problems


def check_adapters(adapters: Sequence[AdapterSpec], *, model: ModelSpec) -> list[Problem]:
    return [
        Problem(
            "adapters",
            f"adapter '{a.name}' belongs to base model '{a.base_model_name}', not '{model.name}'",
        )
        for a in adapters
        if a.base_model_name != model.name
    ]
