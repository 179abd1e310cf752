"""The deployment fit rules, on plain data: each constraint, its message, and properties."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from federation.inventory import fit
from federation.inventory.fit import (
    AdapterSpec,
    DeploymentSpec,
    ModelSpec,
    PoolSpec,
    check_deployment_fit,
)

H100 = PoolSpec(
    name="us-east/h100",
    accelerator_name="H100-80G",
    accelerator_memory_gib=80,
    gpus_per_node=8,
    node_count=2,
    interconnect="nvlink",
    rdma=False,
    gpu_memory_utilization=0.9,
)
L4 = dataclasses.replace(
    H100,
    name="us-east/l4",
    accelerator_name="L4-24G",
    accelerator_memory_gib=24,
    gpus_per_node=4,
    interconnect="pcie",
)
LLAMA_8B = ModelSpec(
    name="llama-8b",
    weight_size_gib=15.0,
    max_context_tokens=8192,
    num_layers=32,
    num_attention_heads=32,
    num_kv_heads=8,
    head_dim=128,
)
LLAMA_70B = ModelSpec(
    name="llama-70b",
    weight_size_gib=131.0,
    max_context_tokens=131072,
    num_layers=80,
    num_attention_heads=64,
    num_kv_heads=8,
    head_dim=128,
)


def dep(tp: int, **kw: object) -> DeploymentSpec:
    fields: dict[str, object] = {
        "tensor_parallel_size": tp,
        "min_replicas": 1,
        "desired_replicas": 1,
        "max_replicas": 1,
    }
    fields.update(kw)
    return DeploymentSpec(**fields)  # type: ignore[arg-type]


def fields_of(problems: list[fit.Problem]) -> list[str]:
    return [p.field for p in problems]


def test_a_sensible_deployment_fits() -> None:
    assert check_deployment_fit(dep(4), model=LLAMA_70B, pool=H100) == []
    assert check_deployment_fit(dep(1), model=LLAMA_8B, pool=L4) == []


def test_memory_problem_names_every_term_with_numbers() -> None:
    [problem] = check_deployment_fit(dep(2), model=LLAMA_70B, pool=H100)
    assert problem.field == "tensor_parallel_size"
    # weights 131/2 = 65.5; KV: 2*80*4*128*2 B/token * 131072 tokens = 20 GiB; runtime 1.5
    assert problem.message == (
        "needs 87.0 GiB per GPU (weights 65.5 + KV cache for one 131072-token sequence 20.0 "
        "+ runtime 1.5) but H100-80G at 0.90 offers 72.0 GiB; raise tensor_parallel_size, "
        "lower max-model-len or use a larger GPU"
    )


def test_memory_estimate_matches_hand_arithmetic() -> None:
    est = fit.memory_per_gpu(LLAMA_8B, L4, tensor_parallel_size=1)
    assert est.weights_gib == 15.0
    assert est.kv_cache_gib == pytest.approx(2 * 32 * 8 * 128 * 2 * 8192 / fit.GIB)  # 1 GiB
    assert est.available_gib == pytest.approx(21.6)
    assert est.fits


def test_max_model_len_and_fp8_kv_cache_shrink_the_reserve() -> None:
    assert check_deployment_fit(dep(2), model=LLAMA_70B, pool=H100)
    # 65.5 + 20 * 4096/131072 + 1.5 = 67.6 <= 72
    assert (
        check_deployment_fit(
            dep(2, engine_args={"max-model-len": 4096}), model=LLAMA_70B, pool=H100
        )
        == []
    )
    half = fit.memory_per_gpu(
        LLAMA_70B, H100, tensor_parallel_size=2, engine_args={"kv-cache-dtype": "fp8_e5m2"}
    )
    assert half.kv_cache_gib == pytest.approx(10.0)


def test_kv_heads_are_replicated_not_split_below_one_per_gpu() -> None:
    one_kv_head = dataclasses.replace(LLAMA_8B, num_kv_heads=1)
    assert fit.kv_cache_bytes_per_token(one_kv_head, tensor_parallel_size=8) == (
        fit.kv_cache_bytes_per_token(one_kv_head, tensor_parallel_size=1)
    )
    assert fit.kv_cache_bytes_per_token(LLAMA_8B, tensor_parallel_size=3) == 2 * 32 * 3 * 128 * 2


def test_tp_beyond_a_node_needs_rdma() -> None:
    problems = check_deployment_fit(dep(16), model=LLAMA_70B, pool=H100)
    assert fields_of(problems) == ["tensor_parallel_size"]
    assert "exceeds the 8 GPUs per node" in problems[0].message
    assert "no RDMA" in problems[0].message


def test_multi_node_tp_with_rdma() -> None:
    rdma = dataclasses.replace(H100, rdma=True)
    assert check_deployment_fit(dep(16), model=LLAMA_70B, pool=rdma) == []
    heads_96 = dataclasses.replace(LLAMA_70B, num_attention_heads=96)
    [multiple] = check_deployment_fit(dep(12), model=heads_96, pool=rdma)
    assert "must be a multiple of the 8 GPUs per node" in multiple.message
    nodes, capacity = check_deployment_fit(dep(32), model=LLAMA_70B, pool=rdma)
    assert "needs 4 nodes of 8 GPUs but pool us-east/h100 has 2" in nodes.message
    assert capacity.field == "desired_replicas"


def test_tp_above_two_needs_nvlink() -> None:
    problems = check_deployment_fit(dep(4), model=LLAMA_8B, pool=L4)
    assert len(problems) == 1
    assert problems[0].message.startswith("tensor_parallel_size 4 > 2 needs NVLink")
    assert "has pcie" in problems[0].message
    assert check_deployment_fit(dep(2), model=LLAMA_8B, pool=L4) == []


def test_attention_heads_must_divide_by_tp() -> None:
    heads_40 = dataclasses.replace(LLAMA_8B, num_attention_heads=40, num_kv_heads=8)
    [problem] = check_deployment_fit(dep(3), model=heads_40, pool=H100)
    assert "num_attention_heads 40 of llama-8b is not divisible by tensor_parallel_size 3" in (
        problem.message
    )
    assert "vLLM refuses" in problem.message


def test_capacity_counts_other_deployments() -> None:
    # H100 pool: 16 GPUs; others claim 3 x TP4 = 12.
    problems = check_deployment_fit(
        dep(4, desired_replicas=2, max_replicas=2),
        model=LLAMA_70B,
        pool=H100,
        other_demands=[(4, 3)],
    )
    assert fields_of(problems) == ["desired_replicas"]
    assert problems[0].message == (
        "needs 8 GPUs (2 replicas x tensor_parallel_size 4) but pool us-east/h100 has 16 GPUs, "
        "12 used by other deployments, 4 free"
    )
    assert check_deployment_fit(dep(4), model=LLAMA_70B, pool=H100, other_demands=[(4, 3)]) == []


def test_pool_gpu_arithmetic() -> None:
    assert fit.replica_gpus(4) == 4
    assert fit.pool_used_gpus([(4, 3), (1, 2)]) == 14
    assert fit.pool_free_gpus(H100, [(4, 3), (1, 2)]) == 2
    assert fit.pool_free_gpus(H100, []) == 16


@pytest.mark.parametrize(
    ("lo", "want", "hi", "field", "text"),
    [
        (2, 1, 3, "min_replicas", "min_replicas 2 exceeds desired_replicas 1"),
        (1, 3, 2, "desired_replicas", "desired_replicas 3 exceeds max_replicas 2"),
        (0, 0, 0, "max_replicas", "max_replicas must be at least 1, got 0"),
        (-1, 1, 1, "min_replicas", "min_replicas must not be negative, got -1"),
    ],
)
def test_replica_bounds(lo: int, want: int, hi: int, field: str, text: str) -> None:
    problems = fit.check_replicas(dep(1, min_replicas=lo, desired_replicas=want, max_replicas=hi))
    assert [(p.field, p.message) for p in problems] == [(field, text)]


def test_zero_desired_replicas_is_a_scaled_to_zero_deployment() -> None:
    assert (
        check_deployment_fit(
            dep(1, min_replicas=0, desired_replicas=0, max_replicas=2),
            model=LLAMA_8B,
            pool=L4,
        )
        == []
    )


@pytest.mark.parametrize(
    ("args", "text"),
    [
        ({"--max-num-seqs": 8}, "without leading dashes"),
        ({"max_num_seqs": 8}, "lowercase-with-hyphens"),
        ({"tensor-parallel-size": 2}, "'tensor-parallel-size' is set by the platform"),
        ({"port": 9000}, "'port' is set by the platform"),
        ({"api-key": "x"}, "'api-key' is set by the platform"),
        ({"max-num-seqs": {"a": 1}}, "'max-num-seqs' takes an integer"),
        ({"cuda-graph-sizes": [1, [2]]}, "takes a list of 1 to 64 integers"),
        ({"max-model-len": 10**9}, "max-model-len must be an integer from 1 to"),
        ({"max-model-len": "4096"}, "'max-model-len' takes an integer"),
        ("--max-num-seqs 8", "must be an object"),
    ],
)
def test_engine_args_refused(args: object, text: str) -> None:
    problems = fit.check_engine_args(args, model=LLAMA_8B)
    assert fields_of(problems) == ["engine_args"]
    assert text in problems[0].message


def test_engine_args_accepted() -> None:
    args = {
        "max-num-seqs": 256,
        "enforce-eager": True,
        "kv-cache-dtype": "fp8",
        "max-model-len": 4096,
        "cuda-graph-sizes": [1, 2, 4],
        "swap-space": 4.5,
        "quantization": None,
    }
    assert fit.check_engine_args(args, model=LLAMA_8B) == []


def test_adapters_must_belong_to_the_base_model() -> None:
    problems = check_deployment_fit(
        dep(1, adapters=(AdapterSpec("sql", "llama-8b"), AdapterSpec("chat", "qwen-7b"))),
        model=LLAMA_8B,
        pool=L4,
    )
    assert [(p.field, p.message) for p in problems] == [
        ("adapters", "adapter 'chat' belongs to base model 'qwen-7b', not 'llama-8b'")
    ]


def test_every_violation_is_reported_at_once() -> None:
    problems = check_deployment_fit(
        dep(4, desired_replicas=9, max_replicas=2, engine_args={"port": 1}),
        model=LLAMA_70B,
        pool=L4,
    )
    assert sorted(set(fields_of(problems))) == [
        "desired_replicas",
        "engine_args",
        "tensor_parallel_size",
    ]
    messages = " | ".join(p.message for p in problems)
    assert "needs NVLink" in messages
    assert "GiB per GPU" in messages
    assert "desired_replicas 9 exceeds max_replicas 2" in messages


def test_non_positive_tp_is_a_problem_not_a_crash() -> None:
    problems = check_deployment_fit(dep(0), model=LLAMA_8B, pool=H100)
    assert ("tensor_parallel_size", "must be at least 1, got 0") in [
        (p.field, p.message) for p in problems
    ]


# --- properties ----------------------------------------------------------------------------

models = st.builds(
    ModelSpec,
    name=st.just("m"),
    weight_size_gib=st.floats(min_value=0.5, max_value=800),
    max_context_tokens=st.integers(min_value=256, max_value=1_000_000),
    num_layers=st.integers(min_value=1, max_value=128),
    num_attention_heads=st.sampled_from([8, 16, 32, 40, 64, 96, 128]),
    num_kv_heads=st.sampled_from([1, 2, 4, 8]),
    head_dim=st.sampled_from([64, 128, 256]),
)
pools = st.builds(
    PoolSpec,
    name=st.just("r/p"),
    accelerator_name=st.just("X"),
    accelerator_memory_gib=st.integers(min_value=8, max_value=192),
    gpus_per_node=st.sampled_from([1, 2, 4, 8]),
    node_count=st.integers(min_value=1, max_value=8),
    interconnect=st.sampled_from(["nvlink", "pcie"]),
    rdma=st.booleans(),
    gpu_memory_utilization=st.floats(min_value=0.1, max_value=0.98),
)
tps = st.sampled_from([1, 2, 4, 8, 16, 32])


@given(model=models, pool=pools, tp=tps, extra_gib=st.integers(min_value=1, max_value=200))
def test_a_fitting_deployment_still_fits_with_more_gpu_memory(
    model: ModelSpec, pool: PoolSpec, tp: int, extra_gib: int
) -> None:
    if check_deployment_fit(dep(tp), model=model, pool=pool):
        return
    bigger = dataclasses.replace(
        pool, accelerator_memory_gib=pool.accelerator_memory_gib + extra_gib
    )
    assert check_deployment_fit(dep(tp), model=model, pool=bigger) == []


@given(model=models, pool=pools, tp=tps, tokens=st.integers(min_value=1, max_value=1_000_000))
def test_a_shorter_max_model_len_never_needs_more_memory(
    model: ModelSpec, pool: PoolSpec, tp: int, tokens: int
) -> None:
    full = fit.memory_per_gpu(model, pool, tensor_parallel_size=tp)
    short = fit.memory_per_gpu(
        model, pool, tensor_parallel_size=tp, engine_args={"max-model-len": tokens}
    )
    assert short.needed_gib <= full.needed_gib


@given(model=models, pool=pools, tp=tps)
def test_doubling_tp_never_raises_memory_per_gpu(model: ModelSpec, pool: PoolSpec, tp: int) -> None:
    one = fit.memory_per_gpu(model, pool, tensor_parallel_size=tp)
    two = fit.memory_per_gpu(model, pool, tensor_parallel_size=tp * 2)
    assert two.needed_gib <= one.needed_gib


@given(pool=pools, demands=st.lists(st.tuples(tps, st.integers(0, 8)), max_size=6))
def test_free_plus_used_is_total(pool: PoolSpec, demands: list[tuple[int, int]]) -> None:
    assert fit.pool_free_gpus(pool, demands) + fit.pool_used_gpus(demands) == pool.total_gpus


@given(model=models, pool=pools, tp=tps)
def test_every_problem_names_a_deployment_field(model: ModelSpec, pool: PoolSpec, tp: int) -> None:
    for problem in check_deployment_fit(dep(tp), model=model, pool=pool):
        assert problem.field in {"tensor_parallel_size", "desired_replicas"}
        assert problem.message


def test_fit_and_lifecycle_are_pure() -> None:
    """The planner and table compiler reuse these without Django: importing them loads none."""
    code = (
        "import sys, federation.inventory.fit, federation.inventory.lifecycle\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in {'django', 'rest_framework'}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
