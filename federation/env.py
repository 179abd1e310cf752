"""Settings from the environment, failing loudly at boot when something required is missing.

fedinfer runs in one of two modes, chosen by ``FEDINFER_MODE``:

* ``embedded`` (default): a laptop or ``make demo``. Every setting has a default: SQLite under
  ``var/``, a broker that needs no server, a fixed development secret key.
* ``production``: nothing is guessed. ``DATABASE_URL``, ``REDIS_URL`` and
  ``FEDINFER_SECRET_KEY`` must be set, or the process refuses to start.
"""

from __future__ import annotations

import os


class ImproperlyConfiguredEnv(RuntimeError):
    """A required environment variable is missing or malformed."""


def is_production() -> bool:
    mode = os.environ.get("FEDINFER_MODE", "embedded")
    if mode not in {"embedded", "production"}:
        raise ImproperlyConfiguredEnv(
            f"FEDINFER_MODE must be 'embedded' or 'production', got {mode!r}"
        )
    return mode == "production"


def env_str(key: str, default: str, *, required_in_production: bool = False) -> str:
    """``key``'s value; in production a required key without a value stops the boot."""
    raw = os.environ.get(key, "")
    if raw:
        return raw
    if required_in_production and is_production():
        raise ImproperlyConfiguredEnv(
            f"{key} is required when FEDINFER_MODE=production (see docs/configuration.md)"
        )
    return default


def env_int(key: str, default: int) -> int:
    raw = os.environ.get(key, "")
    if not raw:
        return default
    try:
        return int(raw)
    except ValueError:
        raise ImproperlyConfiguredEnv(f"{key}={raw!r} is not an integer") from None


def env_bool(key: str, default: bool) -> bool:
    raw = os.environ.get(key, "").strip().lower()
    if not raw:
        return default
    if raw in {"1", "true", "yes", "on"}:
        return True
    if raw in {"0", "false", "no", "off"}:
        return False
    raise ImproperlyConfiguredEnv(f"{key}={raw!r} is not a boolean (use true or false)")


def env_list(key: str, default: list[str]) -> list[str]:
    raw = os.environ.get(key, "")
    if not raw:
        return list(default)
    return [item.strip() for item in raw.split(",") if item.strip()]
