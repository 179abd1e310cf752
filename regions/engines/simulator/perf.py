"""Step-time and memory model of a vLLM engine on a given accelerator (documented with its
reasoning in ``docs/engine-simulator.md``).

One engine step runs the whole batch through the model once. Its time is

    t = T_CPU + (W + P·c_p + D·c_d + A·c_a + K·c_k) · S / (speed · tp^0.85)

* ``T_CPU`` 1.5 ms: scheduling, input preparation, sampling, detokenization (host side; a
  faster GPU does not shorten it).
* ``W`` 7 ms: reading the weights once per step (16 GB of an 8B bf16 model at ~2.3 TB/s
  effective): why a decode step costs ~8.5 ms even at batch 1.
* ``P`` prefill tokens x ``c_p`` 66.7 µs: ~15k prefill tokens/s, compute bound.
* ``D`` decode sequences x ``c_d`` 25 µs: per-sequence matmul rows and sampling.
* ``A`` prefill attention pairs (chunk x context) x ``c_a`` 1.3 ns: the quadratic term.
* ``K`` context tokens read by decode attention x ``c_k`` 0.04 µs (128 KiB of KV per token at
  ~3 TB/s).
* ``S`` = parameters / 8B (weights, FLOPs and, to first order, KV traffic grow with size).
* ``speed``: the accelerator's throughput relative to an H100-80G; ``tp^0.85``: tensor
  parallelism splits the work but pays all-reduces, so 2/4/8 GPUs give 1.8x/3.2x/5.9x.

Pure functions of plain numbers: testable and monotonic in every input.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from regions.engines.accelerators import Accelerator
from regions.engines.simulator.scheduler import StepPlan

T_CPU = 1.5e-3
C_WEIGHTS = 7.0e-3
C_PREFILL = 1.0 / 15_000
C_DECODE = 25e-6
C_ATTN_PAIR = 1.3e-9
C_KV_TOKEN = 0.04e-6
TP_EXPONENT = 0.85
#: KV bytes per token of an 8B Llama-3 (32 layers x 8 KV heads x 128 dims x K,V x bf16).
KV_BYTES_PER_TOKEN_8B = 131_072
GPU_MEMORY_UTILIZATION = 0.9
#: Activations, CUDA graphs and allocator slack per GPU, beyond weights and KV cache.
ACTIVATION_RESERVE_GB = 4.0

_PARAMS_RE = re.compile(r"(?:(\d+)x)?(\d+(?:\.\d+)?)\s*[bB](?![a-zA-Z])")


def model_params_billion(model: str, default: float = 8.0) -> float:
    """Parameter count guessed from a model name (``Llama-3.1-70B`` → 70, ``8x7B`` → 56)."""
    match = _PARAMS_RE.search(model)
    if match is None:
        return default
    experts = int(match.group(1)) if match.group(1) else 1
    return experts * float(match.group(2))


@dataclass(frozen=True, slots=True)
class PerfModel:
    accelerator: Accelerator
    tp: int = 1
    params_billion: float = 8.0

    def __post_init__(self) -> None:
        if self.tp < 1:
            raise ValueError("tensor parallel size must be >= 1")
        if self.params_billion <= 0:
            raise ValueError("parameter count must be positive")

    @property
    def _scale(self) -> float:
        return (self.params_billion / 8.0) / (
            self.accelerator.speed * math.pow(self.tp, TP_EXPONENT)
        )

    def step_time(
        self,
        prefill_tokens: int,
        decode_seqs: int,
        decode_context_tokens: int = 0,
        prefill_attention_pairs: int = 0,
    ) -> float:
        """Seconds one engine step takes (0 for an empty step)."""
        if prefill_tokens <= 0 and decode_seqs <= 0:
            return 0.0
        work = (
            C_WEIGHTS
            + prefill_tokens * C_PREFILL
            + decode_seqs * C_DECODE
            + prefill_attention_pairs * C_ATTN_PAIR
            + decode_context_tokens * C_KV_TOKEN
        )
        return T_CPU + work * self._scale

    def plan_time(self, plan: StepPlan) -> float:
        return self.step_time(
            plan.num_prefill_tokens,
            plan.num_decode_seqs,
            plan.decode_context_tokens,
            plan.prefill_attention_pairs,
        )

    def prefill_tokens_per_second(self) -> float:
        """Steady prefill rate with full 8192-token steps (for documentation and routing)."""
        return 8192 / self.step_time(8192, 0, 0, 8192 * 4096)

    def kv_bytes_per_token(self) -> float:
        # KV width grows slower than parameter count (GQA): 8B → 128 KiB, 70B → ~340 KiB.
        return KV_BYTES_PER_TOKEN_8B * math.pow(self.params_billion / 8.0, 0.45)

    def default_num_gpu_blocks(self, block_size: int = 16) -> int:
        """Blocks that fit beside the weights, as vLLM sizes its cache at start-up."""
        total = self.accelerator.memory_gb * self.tp * GPU_MEMORY_UTILIZATION
        weights = self.params_billion * 2.0  # GB at bf16
        free_gb = total - weights - ACTIVATION_RESERVE_GB * self.tp
        if free_gb <= 0:
            raise ValueError(
                f"a {self.params_billion:g}B model does not fit on {self.tp} x "
                f"{self.accelerator.name} ({total:.0f} GB usable, {weights:.0f} GB of weights)"
            )
        return math.floor(free_gb * 1e9 / (self.kv_bytes_per_token() * block_size))
