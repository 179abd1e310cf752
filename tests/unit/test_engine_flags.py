"""The allowlist of vLLM flags (federation/inventory/engine_flags.py): whatever an operator
writes in ``engine_args``, what reaches vLLM's command line is flags of the allowlist with
values that cannot be read as flags; and the local engines' environment allowlist."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from federation.fleet.spec import EngineSpec, ProvisionerError
from federation.inventory import engine_flags
from workers.provisioners.commands import vllm_args
from workers.provisioners.kubernetes import Cluster, render
from workers.provisioners.local import engine_environment

ANY_VALUE = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner),
    max_leaves=6,
)
NAMES = st.sampled_from(
    [*engine_flags.ENGINE_FLAGS, *engine_flags.PLATFORM_FLAGS, "--host", "host=0.0.0.0", "x"]
)


@given(st.dictionaries(NAMES, ANY_VALUE, max_size=6))
def test_whatever_is_accepted_renders_only_allowlisted_flags_and_no_value_as_a_flag(
    args: dict[str, Any],
) -> None:
    if engine_flags.engine_args_problems(args):
        with pytest.raises(ValueError):
            engine_flags.render(args)
        return
    argv = engine_flags.render(args)
    for token in argv:
        if token.startswith("-"):
            name = token.removeprefix("--")
            assert token.startswith("--") and name in engine_flags.ENGINE_FLAGS, token
            assert name not in engine_flags.PLATFORM_FLAGS


@pytest.mark.parametrize(
    ("args", "named"),
    [
        ({"host": "0.0.0.0"}, "'host' is set by the platform"),
        ({"--host": "0.0.0.0"}, "without leading dashes"),
        ({"max-num-seqs": "--host=0.0.0.0"}, "'max-num-seqs' takes an integer"),
        ({"revision": "--host=0.0.0.0"}, "not starting with '-'"),
        ({"middleware": ["ok.Mw", "-x"]}, "'middleware'"),
        ({"swap-space": float("nan")}, "'swap-space' takes a number"),
        ({"kv-transfer-config": "[1]"}, "'kv-transfer-config' takes a JSON object"),
        ({"trust_remote_code": True}, "'trust_remote_code' is not one fedinfer passes"),
    ],
)
def test_refusals_name_the_flag(args: dict[str, Any], named: str) -> None:
    (problem,) = engine_flags.engine_args_problems(args)
    assert named in problem


def test_admin_only_changes_are_what_is_set_or_changed_not_what_is_removed() -> None:
    old = {"trust-remote-code": True, "chat-template": "a"}
    assert engine_flags.admin_only_changes(old, {"trust-remote-code": True}) == {}
    assert engine_flags.admin_only_changes(old, {"trust-remote-code": False}) == {}
    assert engine_flags.admin_only_changes(old, {"chat-template": "b", "seed": 1}) == {
        "chat-template": ["a", "b"]
    }
    assert engine_flags.admin_only_changes({}, {"middleware": ["m.M"]}) == {
        "middleware": [None, ["m.M"]]
    }


def test_the_renderer_refuses_a_stored_row_the_api_would_refuse() -> None:
    """A row written before the allowlist (or around the API) starts nothing."""
    spec = EngineSpec(
        name="x", url="u", model="m", served_model_name="m", engine_args={"seed": "--port=1"}
    )
    with pytest.raises(ProvisionerError, match="'seed'"):
        vllm_args(spec, host="h", port=1)
    json_flag = EngineSpec(
        name="x",
        url="u",
        model="m",
        served_model_name="m",
        engine_args={"speculative-config": {"num_speculative_tokens": 3, "method": "ngram"}},
    )
    argv = vllm_args(json_flag, host="h", port=1)
    assert argv[argv.index("--speculative-config") + 1].startswith("{")


def test_the_engine_environment_is_an_allowlist() -> None:
    worker = {
        "PATH": "/usr/bin",
        "LC_ALL": "C.UTF-8",
        "CUDA_VISIBLE_DEVICES": "0",
        "HF_HUB_OFFLINE": "1",
        "VLLM_LOGGING_LEVEL": "INFO",
        "FEDINFER_SECRET_KEY": "s",
        "FEDINFER_TABLE_KEYS": "k",
        "DATABASE_URL": "postgres://u:p@h/d",
        "REDIS_URL": "redis://h",
        "CELERY_BROKER_URL": "redis://h",
        "AWS_SECRET_ACCESS_KEY": "a",
    }
    assert engine_environment(worker) == {
        "PATH": "/usr/bin",
        "LC_ALL": "C.UTF-8",
        "CUDA_VISIBLE_DEVICES": "0",
        "HF_HUB_OFFLINE": "1",
        "VLLM_LOGGING_LEVEL": "INFO",
    }


def test_a_kubernetes_engine_gets_a_fixed_environment_never_the_workers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in ("FEDINFER_SECRET_KEY", "DATABASE_URL", "FEDINFER_TABLE_KEYS"):
        monkeypatch.setenv(name, "secret")
    spec = EngineSpec(
        name="x", url="", model="m", served_model_name="m", tensor_parallel_size=16, gpus_per_node=8
    )
    cluster = Cluster(namespace="inference", image="vllm/vllm-openai:v0.32.0")
    containers = [
        c
        for doc in render(spec, cluster) + render(replace(spec, tensor_parallel_size=1), cluster)
        for c in _containers(doc)
    ]
    assert len(containers) >= 3  # a leader and a worker of the group, one single-node pod
    for container in containers:
        assert "envFrom" not in container
        for entry in container.get("env", []):
            # Fixed values, or the pod's own facts (its IP): nothing of the worker's.
            assert entry["name"] not in ("FEDINFER_SECRET_KEY", "DATABASE_URL"), entry
            assert entry.get("value") != "secret", entry
            assert set(entry.get("valueFrom", {})) <= {"fieldRef"}, entry


def _containers(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """Every container of a manifest's pod templates, wherever the kind keeps them."""
    found: list[dict[str, Any]] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            found.extend(node.get("containers", []))
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(doc)
    return found


def test_a_hostile_json_value_costs_a_bounded_check() -> None:
    deep = "[" * 3000 + "]" * 3000
    for value in (deep, '{"a": ' + deep + "}", "{" + " " * 10**6 + "}"):
        (problem,) = engine_flags.engine_args_problems({"rope-scaling": value})
        assert "'rope-scaling' takes a JSON object" in problem
