"""The accelerators engines run on, by the control plane's catalog names: each one's speed
relative to an H100-80G and its memory. The simulator's step-time model reads them
(``simulator/perf.py``), and the local provisioner passes a catalog name to a simulated engine
only when it is one of these."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Accelerator:
    name: str
    #: Throughput relative to an H100-80G (compute and memory bandwidth, blended).
    speed: float
    memory_gb: float


ACCELERATORS: dict[str, Accelerator] = {
    a.name: a
    for a in (
        Accelerator("H100-80G", 1.0, 80),
        Accelerator("H200-141G", 1.25, 141),
        Accelerator("A100-80G", 0.55, 80),
        Accelerator("L40S-48G", 0.45, 48),
        Accelerator("L4-24G", 0.14, 24),
        Accelerator("K100-48G", 0.3, 48),
        Accelerator("B200-192G", 2.2, 192),
        Accelerator("A100-40G", 0.5, 40),
        Accelerator("H20-96G", 0.45, 96),
        Accelerator("MI300X-192G", 1.1, 192),
    )
}
#: Short names people type; the canonical names are the control plane's catalog names.
ACCELERATOR_ALIASES = {"H200": "H200-141G", "L40S": "L40S-48G", "L4": "L4-24G", "B200": "B200-192G"}


def accelerator(name: str) -> Accelerator:
    try:
        return ACCELERATORS[ACCELERATOR_ALIASES.get(name, name)]
    except KeyError:
        known = ", ".join(ACCELERATORS)
        raise ValueError(f"unknown accelerator {name!r}; known: {known}") from None
