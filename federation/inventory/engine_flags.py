"""The vLLM flags a deployment's ``engine_args`` may set: an allowlist, each flag with the type
of its value. Pure, no Django.

An engine runs on the platform's GPUs with the platform's network reach, so ``engine_args``
is a way into that process: a flag fedinfer does not know is refused (not passed on), a
value can never be read as another flag (nothing rendered starts with ``-``), and the flags
that make vLLM run or read code and files of the operator's choosing (``trust-remote-code``,
``middleware``, plugins, a chat template from a path, a KV connector module) are
:attr:`FlagRule.admin_only`: only an admin may set or change them, and the service audits it.
Flags the platform renders itself (``host``, ``port``, ``served-model-name``, parallelism,
prefix caching and its hash, KV events, LoRA modules, ``api-key``, TLS) are never allowed.
The list follows ``vllm serve --help`` of vLLM 0.32 (docs/operations.md, "Engine flags").
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

Kind = Literal["int", "float", "bool", "choice", "str", "int_list", "str_list", "json"]

MAX_ENGINE_ARGS = 64
MAX_STRING_LENGTH = 1000
MAX_LIST_LENGTH = 64
#: A JSON value (``kv-transfer-config``, ``speculative-config``...) rendered at most this long.
MAX_JSON_LENGTH = 4000


@dataclass(frozen=True, slots=True)
class FlagRule:
    """What one flag's value may be. Numbers are bounded below by 0 or more, so none renders
    with a leading ``-``; strings may not start with one either."""

    kind: Kind
    low: float = 0
    high: float = 2**31 - 1
    choices: frozenset[str] = frozenset()
    #: Runs or reads code or files the operator chooses: an admin's decision, audited.
    admin_only: bool = False


def _int(low: int = 0, high: int = 2**31 - 1) -> FlagRule:
    return FlagRule("int", low=low, high=high)


def _float(low: float, high: float) -> FlagRule:
    return FlagRule("float", low=low, high=high)


def _choice(*values: str) -> FlagRule:
    return FlagRule("choice", choices=frozenset(values))


BOOL = FlagRule("bool")
ADMIN_BOOL = FlagRule("bool", admin_only=True)
ADMIN_STR = FlagRule("str", admin_only=True)
ADMIN_JSON = FlagRule("json", admin_only=True)

#: Flags an operator may tune, and (``admin_only``) those only an admin may set.
ENGINE_FLAGS: Mapping[str, FlagRule] = {
    # memory and batching
    "max-model-len": _int(1),  # also bounded by the model's context (fit.check_engine_args)
    "max-num-seqs": _int(1, 65536),
    "max-num-batched-tokens": _int(1, 2**24),
    "max-num-partial-prefills": _int(1, 1024),
    "max-long-partial-prefills": _int(1, 1024),
    "long-prefill-token-threshold": _int(0, 2**24),
    "enable-chunked-prefill": BOOL,
    "block-size": _choice("1", "8", "16", "32", "64", "128"),
    "swap-space": _float(0, 1024),
    "cpu-offload-gb": _float(0, 4096),
    "kv-cache-dtype": _choice("auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc"),
    "calculate-kv-scales": BOOL,
    "dtype": _choice("auto", "half", "float16", "bfloat16", "float", "float32"),
    "quantization": _choice(
        "awq",
        "awq_marlin",
        "gptq",
        "gptq_marlin",
        "marlin",
        "fp8",
        "fbgemm_fp8",
        "modelopt",
        "modelopt_fp4",
        "compressed-tensors",
        "bitsandbytes",
        "gguf",
        "experts_int8",
        "mxfp4",
    ),
    "load-format": _choice("auto", "safetensors", "bitsandbytes", "gguf", "runai_streamer"),
    "max-parallel-loading-workers": _int(1, 256),
    "rope-theta": _float(0, 1e12),
    "rope-scaling": FlagRule("json"),
    "disable-sliding-window": BOOL,
    # scheduling and execution
    "seed": _int(0, 2**32 - 1),
    "scheduling-policy": _choice("fcfs", "priority"),
    "async-scheduling": BOOL,
    "enforce-eager": BOOL,
    "max-seq-len-to-capture": _int(1, 2**24),
    "cuda-graph-sizes": FlagRule("int_list", low=1, high=65536),
    "disable-custom-all-reduce": BOOL,
    "enable-sleep-mode": BOOL,
    "max-cpu-loras": _int(1, 1024),
    "max-logprobs": _int(0, 1_000_000),
    # serving behaviour
    "generation-config": _choice("auto", "vllm"),
    "tokenizer-mode": _choice("auto", "slow", "mistral"),
    "enable-auto-tool-choice": BOOL,
    "tool-call-parser": _choice(
        "hermes",
        "llama3_json",
        "llama4_json",
        "llama4_pythonic",
        "mistral",
        "pythonic",
        "granite",
        "granite-20b-fc",
        "internlm",
        "jamba",
        "deepseek_v3",
        "qwen3_coder",
        "openai",
    ),
    "reasoning-parser": _choice(
        "deepseek_r1", "qwen3", "granite", "glm45", "mistral", "gpt_oss", "hunyuan_a13b"
    ),
    "guided-decoding-backend": _choice("auto", "xgrammar", "guidance", "outlines"),
    "response-role": FlagRule("str"),
    "return-tokens-as-token-ids": BOOL,
    "enable-request-id-headers": BOOL,
    "disable-log-stats": BOOL,
    "enable-log-requests": BOOL,
    "disable-log-requests": BOOL,
    "disable-fastapi-docs": BOOL,
    "uvicorn-log-level": _choice("critical", "error", "warning", "info", "debug"),
    "revision": FlagRule("str"),
    "tokenizer-revision": FlagRule("str"),
    # foreign code or files: an admin's decision, audited
    "trust-remote-code": ADMIN_BOOL,
    "middleware": FlagRule("str_list", admin_only=True),
    "tool-parser-plugin": ADMIN_STR,
    "logits-processors": FlagRule("str_list", admin_only=True),
    "worker-extension-cls": ADMIN_STR,
    "chat-template": ADMIN_STR,  # a path it reads, or a template
    "allowed-local-media-path": ADMIN_STR,
    "download-dir": ADMIN_STR,
    "code-revision": ADMIN_STR,
    "hf-overrides": ADMIN_JSON,
    "kv-transfer-config": ADMIN_JSON,  # kv_connector_module_path imports a module
    "speculative-config": ADMIN_JSON,  # fetches and runs a draft model
}

#: Flags fedinfer renders itself: never from engine_args, whoever asks.
PLATFORM_FLAGS = frozenset(
    {
        "model",
        "served-model-name",
        "host",
        "port",
        "tensor-parallel-size",
        "pipeline-parallel-size",
        "data-parallel-size",
        "gpu-memory-utilization",
        "enable-lora",
        "lora-modules",
        "max-loras",
        "max-lora-rank",
        "api-key",
        "ssl-keyfile",
        "ssl-certfile",
        "enable-prefix-caching",
        "no-enable-prefix-caching",
        # the edges compute the engines' block hashes (regions/engines/block_hash.py)
        "prefix-caching-hash-algo",
        "enable-prompt-tokens-details",
        "kv-events-config",
    }
)
assert not PLATFORM_FLAGS & set(ENGINE_FLAGS)


def _bound(number: float) -> str:
    return str(int(number)) if float(number).is_integer() else f"{number:g}"


def _finite_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _plain_string(value: Any) -> bool:
    """A string that renders as one argument and never as a flag."""
    return (
        isinstance(value, str)
        and 0 < len(value) <= MAX_STRING_LENGTH
        and "\x00" not in value
        and not value.startswith("-")
    )


def _json_text(value: Any) -> str | None:
    """A JSON object given as an object or as its text: its canonical text, else None."""
    if isinstance(value, str):
        if len(value) > MAX_JSON_LENGTH:
            return None
        try:
            value = json.loads(value)
        except (ValueError, RecursionError):
            return None
    if not isinstance(value, dict):
        return None
    try:
        text = json.dumps(value, sort_keys=True, allow_nan=False)
    except (TypeError, ValueError, RecursionError):
        return None
    return text if len(text) <= MAX_JSON_LENGTH else None


def _is_int(value: Any, rule: FlagRule) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and rule.low <= value <= rule.high


def _is_choice(value: Any, rule: FlagRule) -> bool:
    text = str(value) if isinstance(value, int) and not isinstance(value, bool) else value
    return isinstance(text, str) and text in rule.choices


def _is_int_list(value: Any, rule: FlagRule) -> bool:
    return (
        isinstance(value, list)
        and 0 < len(value) <= MAX_LIST_LENGTH
        and all(_is_int(v, rule) for v in value)
    )


def _is_str_list(value: Any, rule: FlagRule) -> bool:
    items = [value] if isinstance(value, str) else value
    return (
        isinstance(items, list)
        and 0 < len(items) <= MAX_LIST_LENGTH
        and all(_plain_string(v) for v in items)
    )


#: kind -> (does a value fit the rule, what the flag takes).
_KINDS: Mapping[Kind, tuple[Callable[[Any, FlagRule], bool], Callable[[FlagRule], str]]] = {
    "bool": (lambda v, _: isinstance(v, bool), lambda _: "true or false"),
    "int": (_is_int, lambda r: f"an integer from {_bound(r.low)} to {_bound(r.high)}"),
    "float": (
        lambda v, r: _finite_number(v) and r.low <= v <= r.high,
        lambda r: f"a number from {_bound(r.low)} to {_bound(r.high)}",
    ),
    "choice": (_is_choice, lambda r: f"one of {', '.join(sorted(r.choices))}"),
    "str": (
        lambda v, _: _plain_string(v),
        lambda _: f"a string of 1 to {MAX_STRING_LENGTH} characters, no NUL, not starting with '-'",
    ),
    "int_list": (
        _is_int_list,
        lambda r: (
            f"a list of 1 to {MAX_LIST_LENGTH} integers from {_bound(r.low)} to {_bound(r.high)}"
        ),
    ),
    "str_list": (
        _is_str_list,
        lambda _: f"a list of 1 to {MAX_LIST_LENGTH} strings, none starting with '-'",
    ),
    "json": (
        lambda v, _: _json_text(v) is not None,
        lambda _: f"a JSON object of at most {MAX_JSON_LENGTH} characters",
    ),
}


def _value_problem(name: str, rule: FlagRule, value: Any) -> str | None:
    """Why ``value`` is not one ``name`` takes, or None (``None`` leaves the flag out)."""
    fits, takes = _KINDS[rule.kind]
    if value is None or fits(value, rule):
        return None
    return f"flag '{name}' takes {takes(rule)}"


def engine_args_problems(engine_args: Any) -> list[str]:
    """Every reason ``engine_args`` (``{"max-num-seqs": 256}``) cannot be passed to vLLM, each
    naming its flag; empty when it can."""
    if not isinstance(engine_args, Mapping):
        return ["must be an object of vLLM flag names to values"]
    if len(engine_args) > MAX_ENGINE_ARGS:
        return [f"at most {MAX_ENGINE_ARGS} flags, got {len(engine_args)}"]
    problems: list[str] = []
    for name in sorted(engine_args, key=str):
        if not isinstance(name, str) or len(name) > 64:
            problems.append(f"flag name {str(name)[:64]!r} is too long")
        elif name.startswith("-"):
            problems.append(
                f"flag name {name!r} must be a vLLM flag without leading dashes, like "
                f"'max-num-seqs'"
            )
        elif name in PLATFORM_FLAGS:
            problems.append(f"flag '{name}' is set by the platform and cannot be overridden")
        elif name not in ENGINE_FLAGS:
            problems.append(
                f"flag {name!r} is not one fedinfer passes to vLLM (lowercase-with-hyphens "
                f"names from the allowlist in docs/operations.md, 'Engine flags')"
            )
        else:
            problem = _value_problem(name, ENGINE_FLAGS[name], engine_args[name])
            if problem:
                problems.append(problem)
    return problems


def admin_only_changes(old: Any, new: Mapping[str, Any]) -> dict[str, list[Any]]:
    """``{flag: [old, new]}`` of the admin-only flags ``new`` sets or changes (a flag removed
    or turned off takes foreign code away, so anyone may do that)."""
    before = old if isinstance(old, Mapping) else {}
    changes: dict[str, list[Any]] = {}
    for name, value in new.items():
        rule = ENGINE_FLAGS.get(name)
        if rule is None or not rule.admin_only or value is None or value is False:
            continue
        if before.get(name) != value:
            changes[name] = [before.get(name), value]
    return changes


def render(engine_args: Mapping[str, Any]) -> list[str]:
    """``{'max-num-seqs': 256, 'enforce-eager': True}`` → ``--max-num-seqs 256
    --enforce-eager``: False or None leaves a flag out, a list repeats its values, a JSON
    flag is one canonical JSON argument. Raises ValueError naming every flag that is not
    allowed (the same rules as the API: rows written before them are not passed on)."""
    problems = engine_args_problems(engine_args)
    if problems:
        raise ValueError("; ".join(problems))
    out: list[str] = []
    for name in sorted(engine_args):
        value = engine_args[name]
        kind = ENGINE_FLAGS[name].kind
        if value is None or value is False:
            continue
        if value is True:
            out.append(f"--{name}")
        elif kind == "json":
            out += [f"--{name}", str(_json_text(value))]
        elif isinstance(value, list):
            out += [f"--{name}", *(str(v) for v in value)]
        else:
            out += [f"--{name}", f"{value:g}" if isinstance(value, float) else str(value)]
    return out
