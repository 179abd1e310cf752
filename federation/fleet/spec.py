"""What a provisioner is asked to run, and the interface every provisioner offers.

Plain data, no Django: the fleet's services build an :class:`EngineSpec` from a deployment and
hand it to a :class:`Provisioner` (``workers/provisioners/``: local processes, Kubernetes).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol


class ProvisionerError(RuntimeError):
    """A provisioner could not do what it was asked (bad spec, cluster refused, no binary)."""


@dataclass(frozen=True, slots=True)
class Adapter:
    name: str
    source: str
    rank: int


@dataclass(frozen=True, slots=True)
class EngineSpec:
    """One engine (replica) of a deployment, as vLLM needs it."""

    name: str  # the instance's name: unique, a DNS label
    url: str  # where it will answer (from :meth:`Provisioner.endpoint_for`)
    model: str  # weights to load (a hub id or a path)
    served_model_name: str  # what clients send as "model"
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float = 0.9
    max_model_len: int | None = None
    gpus_per_node: int = 8
    accelerator: str = ""
    role: str = "mixed"
    adapters: tuple[Adapter, ...] = ()
    #: Extra vLLM flags {'max-num-seqs': 256}; True is a bare flag.
    engine_args: dict[str, Any] = field(default_factory=dict)
    #: Publish KV-cache events (the edges' prefix index subscribes to them).
    kv_events_port: int | None = None


@dataclass(frozen=True, slots=True)
class Running:
    """One engine a provisioner runs, as its own listing finds it."""

    name: str
    url: str
    detail: dict[str, Any] = field(default_factory=dict)


class Provisioner(Protocol):
    """Starts and stops engines. Its listing (:meth:`running`) is the truth the worker
    reconciles the database with after a crash: what it lists and no live instance claims is an
    orphan and is stopped; a live instance it does not list has died."""

    kind: str

    def endpoint_for(self, name: str) -> str:
        """The URL the engine ``name`` will answer on, known before it is started (the
        instance row is stored first, so a crash never leaves an engine nobody recorded)."""
        ...

    def start(self, spec: EngineSpec) -> Running:
        """Start the engine; idempotent (an engine of that name already running is returned)."""
        ...

    def stop(self, name: str) -> None:
        """Stop the engine and forget it; nothing to stop is not an error."""
        ...

    def is_running(self, name: str) -> bool: ...

    def running(self) -> dict[str, Running]:
        """Every engine this provisioner runs now, by name."""
        ...
