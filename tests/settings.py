"""Test settings: the real PostgreSQL and Redis of this machine unless told otherwise."""

import os

from tests.isolation import worker_redis_url

os.environ.setdefault("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/fedinfer")
# Each xdist worker its own Redis database, also for the processes the tests start.
os.environ["REDIS_URL"] = worker_redis_url(os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/15"))

from federation.settings import *  # noqa: F403

PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]

# Tests share one cache and log in often; the login throttle has its own test.
CACHES = {"default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"}}
FEDINFER_LOGIN_RATE = "10000/min"
