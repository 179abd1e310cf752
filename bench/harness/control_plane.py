"""The real control plane's set-up, shared by the benchmarks that run on it (federation,
metering, console, failover, cold-start): the model they all register and a fresh, migrated
database of their own, so a benchmark never touches the developer's data."""

from __future__ import annotations

import os
from decimal import Decimal
from typing import Any
from urllib.parse import urlsplit, urlunsplit

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
#: The model every benchmark on the real control plane registers.
MODEL_SPEC: dict[str, Any] = {
    "name": MODEL,
    "family": "llama-3.1",
    "parameter_count_b": Decimal("8.03"),
    "dtype": "bf16",
    "weight_size_gib": 15.0,
    "max_context_tokens": 8192,
    "num_layers": 32,
    "num_attention_heads": 32,
    "num_kv_heads": 8,
    "head_dim": 128,
}


def bench_database(url: str) -> str:
    """Drop and create ``<db>_fedbench`` on the server of ``url``; its URL."""
    import psycopg

    parts = urlsplit(url)
    name = parts.path.lstrip("/") + "_fedbench"
    admin = urlunsplit(parts._replace(path="/postgres", scheme="postgresql"))
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        conn.execute(f'CREATE DATABASE "{name}"')
    return urlunsplit(parts._replace(path="/" + name))


def django_on_bench_database(db_url: str, redis_url: str, **env: str) -> str:
    """Django set up, migrated, on a fresh ``<db>_fedbench`` database and a flushed Redis db
    (broker included); the database's URL, for the processes the bench starts."""
    import django
    import redis
    from django.core.management import call_command

    url = bench_database(db_url)
    os.environ.update(
        {
            "DJANGO_SETTINGS_MODULE": "federation.settings",
            "DATABASE_URL": url,
            "REDIS_URL": redis_url,
            "CELERY_BROKER_URL": redis_url,
            **env,
        }
    )
    redis.Redis.from_url(redis_url).flushdb()
    django.setup()
    call_command("migrate", verbosity=0)
    return url


def setup_django(database_url: str) -> None:
    """Django on ``database_url``, migrated: for the benchmarks that need the ORM but no worker."""
    os.environ["DATABASE_URL"] = database_url
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "federation.settings")
    import django
    from django.core.management import call_command

    django.setup()
    call_command("migrate", verbosity=0)
