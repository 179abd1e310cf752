"""Fault injection for tests of the edge: what a sick or dying vLLM server looks like.

Faults are set per engine, by ``--fault`` at start or ``POST /admin/faults`` at run time:

* ``health_fail``: ``GET /health`` answers 503 (the engine still serves requests).
* ``error_rate``: this fraction of generation requests gets vLLM's 500 JSON error.
* ``latency_ms``: added before a generation request is processed (shows in TTFT).
* ``hang_rate``: this fraction of generation requests is accepted and never answered.
* ``die_after_tokens`` (with ``die_rate``, default 1): the connection is closed after that many
  tokens of a response, without finishing it (a process that died mid-stream).
* ``kill`` (admin) / ``kill_after_s`` (flag): the engine stops listening and cuts every
  connection it has; the other engines of the process keep running.

Decisions come from a generator seeded per engine and draw the same numbers per request
whatever the configuration, so the fate of the k-th request served while a fault is set
depends only on the seed and k.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, fields
from typing import Any


@dataclass(slots=True)
class FaultConfig:
    health_fail: bool = False
    error_rate: float = 0.0
    latency_ms: float = 0.0
    hang_rate: float = 0.0
    die_after_tokens: int | None = None
    die_rate: float = 1.0
    kill_after_s: float | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def active(self) -> bool:
        return (
            self.error_rate > 0
            or self.latency_ms > 0
            or self.hang_rate > 0
            or (self.die_after_tokens is not None and self.die_rate > 0)
        )


_FIELDS = {f.name for f in fields(FaultConfig)}
_RATES = ("error_rate", "hang_rate", "die_rate")


def apply_update(config: FaultConfig, update: dict[str, Any]) -> FaultConfig:
    """A new config with ``update`` applied; ``ValueError`` names any bad key or value."""
    values = config.as_dict()
    for key, value in update.items():
        if key not in _FIELDS:
            raise ValueError(f"unknown fault {key!r}; known: {', '.join(sorted(_FIELDS))}")
        if key == "health_fail":
            if not isinstance(value, bool):
                raise ValueError("health_fail must be true or false")
        elif key in ("die_after_tokens", "kill_after_s") and value is None:
            pass
        elif key == "die_after_tokens":
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError("die_after_tokens must be a non-negative integer or null")
        else:
            if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
                raise ValueError(f"{key} must be a non-negative number")
            if key in _RATES and value > 1:
                raise ValueError(f"{key} must be between 0 and 1")
            value = float(value)
        values[key] = value
    return FaultConfig(**values)


def parse_fault_flag(spec: str) -> tuple[int | None, dict[str, Any]]:
    """``[ENGINE:]key=value[,key=value]`` → (engine index or None for all, update dict)."""
    engine: int | None = None
    head, sep, rest = spec.partition(":")
    if sep and head.isdigit():
        engine, spec = int(head), rest
    update: dict[str, Any] = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        key, eq, raw = item.partition("=")
        key = key.strip().replace("-", "_")
        if not eq:
            if key in ("health_fail",):
                update[key] = True
                continue
            raise ValueError(f"fault {item!r} needs a value (key=value)")
        raw = raw.strip()
        value: Any
        if raw.lower() in ("true", "false"):
            value = raw.lower() == "true"
        elif raw.lower() in ("none", "null"):
            value = None
        else:
            try:
                value = int(raw)
            except ValueError:
                try:
                    value = float(raw)
                except ValueError:
                    raise ValueError(f"fault {item!r}: {raw!r} is not a number") from None
        update[key] = value
    if not update:
        raise ValueError(f"empty fault spec {spec!r}")
    return engine, update


@dataclass(frozen=True, slots=True)
class Fate:
    """What happens to one generation request."""

    error: bool = False
    hang: bool = False
    die_after_tokens: int | None = None
    latency_s: float = 0.0


NO_FAULT = Fate()


class FaultInjector:
    def __init__(self, seed: int, config: FaultConfig | None = None):
        self.config = config or FaultConfig()
        self._rng = random.Random(seed)
        self.requests_seen = 0

    def update(self, update: dict[str, Any]) -> FaultConfig:
        self.config = apply_update(self.config, update)
        return self.config

    def reset(self) -> FaultConfig:
        self.config = FaultConfig()
        return self.config

    def fate(self) -> Fate:
        """Decide the next request's fate (three draws per request, always)."""
        cfg = self.config
        if not cfg.active:
            return NO_FAULT  # no draws: the zero-fault hot path stays cheap
        self.requests_seen += 1
        rng = self._rng.random
        r_error, r_hang, r_die = rng(), rng(), rng()
        die = (
            cfg.die_after_tokens
            if cfg.die_after_tokens is not None and r_die < cfg.die_rate
            else None
        )
        return Fate(
            error=r_error < cfg.error_rate,
            hang=r_hang < cfg.hang_rate,
            die_after_tokens=die,
            latency_s=cfg.latency_ms / 1000.0,
        )
