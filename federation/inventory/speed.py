"""How fast a replica serves: the speed model the compiler plans capacity with and metering
allocates cost with. Pure: no Django, no I/O.

A replica's prefill is compute bound, so it scales with its accelerator's relative speed and
inversely with the model's parameter count; tensor parallelism pays all-reduces, so N GPUs give
N^0.85 (the simulator's model too, docs/engine-simulator.md). Decode is memory-bandwidth bound
and scales the same way from its own reference.
"""

from __future__ import annotations

#: Prefill throughput of an 8B model on one H100-80G, tokens/s.
REFERENCE_PREFILL_TOKENS_PER_S = 15_000.0
REFERENCE_PARAMS_B = 8.0
TP_EXPONENT = 0.85
#: Generated tokens/s of the same replica with a full batch (~64 sequences at 2k context: one
#: 15 ms step per 64 tokens in the simulator's model). Decode is memory-bandwidth bound.
REFERENCE_DECODE_TOKENS_PER_S = 4_000.0
#: Share of prompt tokens in the traffic (chat and RAG: about three prompt tokens per
#: generated one); blends the two rates into one token throughput.
PROMPT_TOKEN_SHARE = 0.75


def prefill_tokens_per_s(
    *, relative_speed: float, tensor_parallel_size: int, params_b: float
) -> float:
    """Expected prefill throughput of one replica, tokens per second."""
    return (
        REFERENCE_PREFILL_TOKENS_PER_S
        * relative_speed
        * tensor_parallel_size**TP_EXPONENT
        * REFERENCE_PARAMS_B
        / params_b
    )


def decode_tokens_per_s(
    *, relative_speed: float, tensor_parallel_size: int, params_b: float
) -> float:
    """Expected generated tokens per second of one replica with a full batch."""
    return (
        REFERENCE_DECODE_TOKENS_PER_S
        * relative_speed
        * tensor_parallel_size**TP_EXPONENT
        * REFERENCE_PARAMS_B
        / params_b
    )


def replica_tokens_per_s(
    *, relative_speed: float, tensor_parallel_size: int, params_b: float
) -> float:
    """Prompt plus generated tokens per second one replica sustains at full load: the
    harmonic blend of its prefill and decode rates at :data:`PROMPT_TOKEN_SHARE`."""
    prefill = prefill_tokens_per_s(
        relative_speed=relative_speed, tensor_parallel_size=tensor_parallel_size, params_b=params_b
    )
    decode = decode_tokens_per_s(
        relative_speed=relative_speed, tensor_parallel_size=tensor_parallel_size, params_b=params_b
    )
    return 1.0 / (PROMPT_TOKEN_SHARE / prefill + (1.0 - PROMPT_TOKEN_SHARE) / decode)
