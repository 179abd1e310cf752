"""Django settings for the fedinfer control plane, read from the environment (federation.env)."""

from __future__ import annotations

import hmac
import re
from pathlib import Path

import dj_database_url

from federation.env import (
    ImproperlyConfiguredEnv,
    env_bool,
    env_int,
    env_list,
    env_str,
    is_production,
)

BASE_DIR = Path(__file__).resolve().parent.parent
VAR_DIR = Path(env_str("FEDINFER_VAR_DIR", str(BASE_DIR / "var")))
PRODUCTION = is_production()
if not PRODUCTION:
    VAR_DIR.mkdir(parents=True, exist_ok=True)

SECRET_KEY = env_str(
    "FEDINFER_SECRET_KEY",
    "embedded-insecure-key-do-not-use-in-production",
    required_in_production=True,
)
DEBUG = env_bool("FEDINFER_DEBUG", not PRODUCTION)
if PRODUCTION and DEBUG:
    raise ImproperlyConfiguredEnv(
        "FEDINFER_DEBUG=true is refused when FEDINFER_MODE=production: debug pages show "
        "settings and source code to anyone who triggers an error"
    )
ALLOWED_HOSTS = env_list(
    "FEDINFER_ALLOWED_HOSTS", ["localhost", "127.0.0.1", "[::1]", "testserver"]
)
CSRF_TRUSTED_ORIGINS = env_list("FEDINFER_CSRF_TRUSTED_ORIGINS", [])

INSTALLED_APPS = [
    # django.contrib.admin, with its login behind the login throttle.
    "federation.core.apps.FedinferAdminConfig",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "django_filters",
    "drf_spectacular",
    "drf_spectacular_sidecar",
    "federation.core",
    "federation.inventory",
    "federation.tenancy",
    "federation.routing",
    "federation.telemetry",
    "federation.metering",
    "federation.demo",
    "federation.fleet",
    "console.apps.ConsoleConfig",
    # The Celery app, loaded wherever Django runs: domains queue tasks by name on it.
    "workers.apps.WorkersConfig",
]

MIDDLEWARE = [
    "federation.core.metrics.RequestMetricsMiddleware",
    "django.middleware.security.SecurityMiddleware",
    "federation.core.csp.ContentSecurityPolicyMiddleware",
    "federation.api.middleware.RequestBodyLimitMiddleware",
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

ROOT_URLCONF = "federation.urls"
WSGI_APPLICATION = "federation.wsgi.application"
ASGI_APPLICATION = "federation.asgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

_default_db = f"sqlite:///{VAR_DIR / 'fedinfer.sqlite3'}"
DATABASES = {
    "default": dj_database_url.parse(
        env_str("DATABASE_URL", _default_db, required_in_production=True),
        conn_max_age=env_int("FEDINFER_DB_CONN_MAX_AGE", 60),
    )
}
if DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3":
    # The embedded demo has several writers (web, worker, heartbeats): take the write lock at
    # BEGIN and wait for it, instead of failing with "database is locked" mid-transaction.
    DATABASES["default"].setdefault("OPTIONS", {}).update(
        {"transaction_mode": "IMMEDIATE", "timeout": 20}
    )
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

# Every app's migrations live in the top-level migrations/ package.
MIGRATION_MODULES = {
    "core": "migrations.core",
    "inventory": "migrations.inventory",
    "tenancy": "migrations.tenancy",
    "routing": "migrations.routing",
    "metering": "migrations.metering",
    "fleet": "migrations.fleet",
}

REDIS_URL = env_str("REDIS_URL", "", required_in_production=True)

# Throttle counters must be shared by every web process: Redis when there is one. While it is
# down the login throttle counts per process (federation.api.throttles.FallbackCache); the
# timeouts keep an unreachable Redis from holding each login for long.
CACHES = {
    "default": (
        {
            "BACKEND": "django.core.cache.backends.redis.RedisCache",
            "LOCATION": REDIS_URL,
            "OPTIONS": {"socket_connect_timeout": 1, "socket_timeout": 1},
        }
        if REDIS_URL
        else {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"}
    )
}
#: Login attempts (``POST /api/v1/auth/token/`` and the admin's login form) per client address.
FEDINFER_LOGIN_RATE = env_str("FEDINFER_LOGIN_RATE", "20/min")
#: How many reverse proxies of ours stand in front of the web processes. 0: the client address
#: is the peer's and X-Forwarded-For is ignored (a client could write anything there); N: the
#: Nth address from the right of X-Forwarded-For (federation.api.throttles.client_address).
FEDINFER_TRUSTED_PROXIES = env_int("FEDINFER_TRUSTED_PROXIES", 0)
if FEDINFER_TRUSTED_PROXIES < 0:
    raise ImproperlyConfiguredEnv("FEDINFER_TRUSTED_PROXIES must be 0 or more")
CELERY_BROKER_URL = env_str("CELERY_BROKER_URL", REDIS_URL or "filesystem://")
# The embedded broker is a folder: producers and the worker share it (kombu's filesystem
# transport), so `fedinfer demo` needs no server.
_broker_dir = VAR_DIR / "broker"
CELERY_BROKER_TRANSPORT_OPTIONS = (
    {
        "data_folder_in": str(_broker_dir),
        "data_folder_out": str(_broker_dir),
        # Without it kombu writes its broadcast exchange into ./control of the working dir.
        "control_folder": str(_broker_dir / "control"),
    }
    if CELERY_BROKER_URL.startswith("filesystem://")
    else {}
)
if CELERY_BROKER_URL.startswith("filesystem://") and not PRODUCTION:
    (_broker_dir / "control").mkdir(parents=True, exist_ok=True)
CELERY_TASK_IGNORE_RESULT = True
CELERY_TASK_SERIALIZER = "json"
CELERY_ACCEPT_CONTENT = ["json"]
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
# Embedded beat keeps its schedule in memory: its only entries are short intervals.
CELERY_BEAT_SCHEDULER = "celery.beat:Scheduler"
#: Seconds between periodic recompiles (telemetry changes without an inventory write).
FEDINFER_TABLES_REFRESH_SECONDS = env_int("FEDINFER_TABLES_REFRESH_SECONDS", 30)
# Shortest time between two recompiles that re-lease budgets after spend was counted.
FEDINFER_BUDGET_RELEASE_SECONDS = env_int("FEDINFER_BUDGET_RELEASE_SECONDS", 5)
#: A region restored or back from losing all its instances gets its traffic back in
#: FEDINFER_RAMP_STEPS steps over FEDINFER_RAMP_SECONDS (docs/edge-federation.md).
FEDINFER_RAMP_SECONDS = env_int("FEDINFER_RAMP_SECONDS", 60)
FEDINFER_RAMP_STEPS = env_int("FEDINFER_RAMP_STEPS", 4)
#: Published table versions kept per region however old (the newest ones), and how long the
#: others are kept; a version an edge reports as applied is kept too (docs/distribution.md).
FEDINFER_TABLE_VERSIONS_KEPT = env_int("FEDINFER_TABLE_VERSIONS_KEPT", 50)
FEDINFER_TABLE_RETENTION_HOURS = env_int("FEDINFER_TABLE_RETENTION_HOURS", 24)
FEDINFER_TABLE_PRUNE_SECONDS = env_int("FEDINFER_TABLE_PRUNE_SECONDS", 600)
#: Seconds between usage rollups (hourly and daily sums, pool costs: docs/metering.md).
FEDINFER_USAGE_ROLLUP_SECONDS = env_int("FEDINFER_USAGE_ROLLUP_SECONDS", 15)
CELERY_BEAT_SCHEDULE: dict[str, dict[str, object]] = {
    "routing-tables-refresh": {
        "task": "fedinfer.routing_tables.publish",  # routing.services.PUBLISH_TASK
        "schedule": float(FEDINFER_TABLES_REFRESH_SECONDS),
    },
    "usage-rollup": {
        "task": "fedinfer.usage.rollup",
        "schedule": float(FEDINFER_USAGE_ROLLUP_SECONDS),
    },
    "routing-tables-prune": {
        "task": "fedinfer.routing_tables.prune",
        "schedule": float(FEDINFER_TABLE_PRUNE_SECONDS),
    },
}
# The fleet: lifecycle, replica counts and failover (docs/operations.md).
FEDINFER_FLEET_INTERVAL_SECONDS = env_int("FEDINFER_FLEET_INTERVAL_SECONDS", 2)
FEDINFER_FLEET_PROBE_TIMEOUT_SECONDS = env_int("FEDINFER_FLEET_PROBE_TIMEOUT_SECONDS", 2)
FEDINFER_FLEET_REPORT_FRESH_SECONDS = env_int("FEDINFER_FLEET_REPORT_FRESH_SECONDS", 10)
FEDINFER_FLEET_FAIL_AFTER = env_int("FEDINFER_FLEET_FAIL_AFTER", 3)
FEDINFER_FLEET_RECOVER_AFTER = env_int("FEDINFER_FLEET_RECOVER_AFTER", 2)
FEDINFER_FLEET_LOADING_TIMEOUT_SECONDS = env_int("FEDINFER_FLEET_LOADING_TIMEOUT_SECONDS", 600)
FEDINFER_FLEET_WARMING_TIMEOUT_SECONDS = env_int("FEDINFER_FLEET_WARMING_TIMEOUT_SECONDS", 300)
FEDINFER_FLEET_DRAIN_TIMEOUT_SECONDS = env_int("FEDINFER_FLEET_DRAIN_TIMEOUT_SECONDS", 60)
FEDINFER_FAILOVER_EDGE_SILENCE_SECONDS = env_int("FEDINFER_FAILOVER_EDGE_SILENCE_SECONDS", 15)
FEDINFER_FAILOVER_FAILED_PERCENT = env_int("FEDINFER_FAILOVER_FAILED_PERCENT", 50)
FEDINFER_FAILOVER_MIN_FAILED = env_int("FEDINFER_FAILOVER_MIN_FAILED", 2)
FEDINFER_FAILOVER_FAILED_WINDOW_SECONDS = env_int("FEDINFER_FAILOVER_FAILED_WINDOW_SECONDS", 60)
FEDINFER_FAILOVER_RESTORE_AFTER_SECONDS = env_int("FEDINFER_FAILOVER_RESTORE_AFTER_SECONDS", 30)
# The autoscaler (docs/operations.md): utilisation target and band, in percent; a replica is
# removed once the load stayed below the band for the down window, not sooner than the
# cooldown after the last change.
FEDINFER_AUTOSCALE_TARGET_PERCENT = env_int("FEDINFER_AUTOSCALE_TARGET_PERCENT", 65)
FEDINFER_AUTOSCALE_LOW_PERCENT = env_int("FEDINFER_AUTOSCALE_LOW_PERCENT", 60)
FEDINFER_AUTOSCALE_HIGH_PERCENT = env_int("FEDINFER_AUTOSCALE_HIGH_PERCENT", 70)
FEDINFER_AUTOSCALE_DOWN_WINDOW_SECONDS = env_int("FEDINFER_AUTOSCALE_DOWN_WINDOW_SECONDS", 60)
FEDINFER_AUTOSCALE_COOLDOWN_SECONDS = env_int("FEDINFER_AUTOSCALE_COOLDOWN_SECONDS", 120)
FEDINFER_AUTOSCALE_SMOOTHING_SECONDS = env_int("FEDINFER_AUTOSCALE_SMOOTHING_SECONDS", 20)
# Scale to zero: a cold model's expected cold start before one was measured (the edges hold its
# first requests up to it, within their own --cold-hold-max), and how often at most a
# heartbeat that reports requests held for a cold model queues an autoscale pass at once.
FEDINFER_COLD_START_DEFAULT_SECONDS = env_int("FEDINFER_COLD_START_DEFAULT_SECONDS", 120)
FEDINFER_COLD_WAKE_SPACING_SECONDS = env_int("FEDINFER_COLD_WAKE_SPACING_SECONDS", 2)
# A registered LoRA adapter not loaded where its base model runs is a cold model there too; a
# request for it loads it onto the running replicas (vLLM's runtime load_lora_adapter) in about
# this long (the edges hold requests up to it plus their margin).
FEDINFER_ADAPTER_LOAD_SECONDS = env_int("FEDINFER_ADAPTER_LOAD_SECONDS", 30)
if not (
    0
    < FEDINFER_AUTOSCALE_LOW_PERCENT
    <= FEDINFER_AUTOSCALE_TARGET_PERCENT
    <= FEDINFER_AUTOSCALE_HIGH_PERCENT
    <= 100
):
    raise ImproperlyConfiguredEnv(
        "FEDINFER_AUTOSCALE_*_PERCENT must satisfy 0 < LOW <= TARGET <= HIGH <= 100"
    )
FEDINFER_LOCAL_ENGINE = env_str("FEDINFER_LOCAL_ENGINE", "sim")  # sim | vllm
FEDINFER_LOCAL_ENGINES_DIR = Path(env_str("FEDINFER_LOCAL_ENGINES_DIR", str(VAR_DIR / "engines")))
FEDINFER_VLLM_PYTHON = env_str("FEDINFER_VLLM_PYTHON", str(BASE_DIR / ".venv-vllm/bin/python"))
FEDINFER_KUBERNETES_NAMESPACE = env_str("FEDINFER_KUBERNETES_NAMESPACE", "")
FEDINFER_KUBERNETES_IMAGE = env_str("FEDINFER_KUBERNETES_IMAGE", "vllm/vllm-openai:v0.32.0")
if FEDINFER_LOCAL_ENGINE not in ("sim", "vllm"):
    raise ImproperlyConfiguredEnv("FEDINFER_LOCAL_ENGINE must be 'sim' or 'vllm'")
#: The autoscale pass's period (the reconcile pass's by default); a heartbeat reporting requests
#: held for a cold model queues one at once.
FEDINFER_AUTOSCALE_INTERVAL_SECONDS = env_int(
    "FEDINFER_AUTOSCALE_INTERVAL_SECONDS", FEDINFER_FLEET_INTERVAL_SECONDS
)
for _task, _every in (
    ("reconcile", FEDINFER_FLEET_INTERVAL_SECONDS),
    ("failover", FEDINFER_FLEET_INTERVAL_SECONDS),
    ("autoscale", FEDINFER_AUTOSCALE_INTERVAL_SECONDS),
):
    CELERY_BEAT_SCHEDULE[f"fleet-{_task}"] = {
        "task": f"fedinfer.fleet.{_task}",
        "schedule": float(_every),
        # A pass still queued three periods on is dropped, not piled up behind slow ones. Not
        # one period: the passes share the workers, and a reconcile that takes a period would
        # then expire every failover pass queued behind it, each period, for good.
        "options": {"expires": 3.0 * _every},
    }
#: The placement planner on a schedule (docs/operations.md): every this many seconds (0: off),
#: in mode ``plan`` (keep the dry run: the API lists it) or ``apply`` (apply it when it changes
#: something and the fleet did not change meanwhile).
FEDINFER_PLACEMENT_INTERVAL_SECONDS = env_int("FEDINFER_PLACEMENT_INTERVAL_SECONDS", 0)
FEDINFER_PLACEMENT_MODE = env_str("FEDINFER_PLACEMENT_MODE", "plan")
if FEDINFER_PLACEMENT_MODE not in ("plan", "apply"):
    raise ImproperlyConfiguredEnv("FEDINFER_PLACEMENT_MODE must be 'plan' or 'apply'")
if FEDINFER_PLACEMENT_INTERVAL_SECONDS > 0:
    CELERY_BEAT_SCHEDULE["fleet-placement"] = {
        "task": "fedinfer.fleet.placement",
        "schedule": float(FEDINFER_PLACEMENT_INTERVAL_SECONDS),
        # A pass that missed its turn is dropped: the next one plans on fresher data.
        "options": {"expires": float(FEDINFER_PLACEMENT_INTERVAL_SECONDS)},
    }
if REDIS_URL:
    # Edges ship usage to the Redis stream; without Redis they POST it to the control plane.
    CELERY_BEAT_SCHEDULE["usage-ingest"] = {"task": "fedinfer.usage.ingest", "schedule": 2.0}
#: HMAC key of routing tables. Production requires it (edges hold the same key); embedded
#: mode derives one from SECRET_KEY so the demo's edges and control plane agree.
FEDINFER_TABLE_SIGNING_KEY = env_str(
    "FEDINFER_TABLE_SIGNING_KEY",
    hmac.new(SECRET_KEY.encode(), b"fedinfer routing-table signing", "sha256").hexdigest(),
    required_in_production=True,
)
FEDINFER_TABLE_SIGNING_KEY_ID = env_str("FEDINFER_TABLE_SIGNING_KEY_ID", "k1")

#: Bearer token that may read /metrics; empty: loopback clients may (federation.core.metrics).
FEDINFER_METRICS_TOKEN = env_str("FEDINFER_METRICS_TOKEN", "")

#: Port of the worker's /metrics (workers.metrics; 0: not served) and the address it binds.
FEDINFER_WORKER_METRICS_PORT = env_int("FEDINFER_WORKER_METRICS_PORT", 0)
FEDINFER_WORKER_METRICS_ADDR = env_str("FEDINFER_WORKER_METRICS_ADDR", "127.0.0.1")

#: OTLP/HTTP traces URL (e.g. http://collector:4318/v1/traces) for spans of the web's requests
#: and the worker's tasks (federation.core.tracing); empty: no tracing. Needs fedinfer[tracing].
FEDINFER_OTLP_ENDPOINT = env_str("FEDINFER_OTLP_ENDPOINT", "")
#: Share of new traces recorded (0..1); a caller's sampled traceparent decides for its own.
FEDINFER_TRACE_SAMPLE_RATIO = env_str("FEDINFER_TRACE_SAMPLE_RATIO", "1.0")

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
]

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

LOGIN_URL = "console:login"

STATIC_URL = "static/"
STATIC_ROOT = VAR_DIR / "static"
# Serve app static files (console, Swagger UI) straight from the packages, no collectstatic step.
WHITENOISE_USE_FINDERS = True
if not PRODUCTION:
    STATIC_ROOT.mkdir(parents=True, exist_ok=True)

# A request body above this is refused with 413 before it is parsed.
DATA_UPLOAD_MAX_MEMORY_SIZE = env_int("FEDINFER_MAX_BODY_BYTES", 1024 * 1024)

# --- HTTPS and browser hardening --------------------------------------------------------
# `fedinfer serve` speaks plain HTTP: in production TLS ends at a proxy or load balancer in
# front, which tells the original scheme in the header FEDINFER_PROXY_SSL_HEADER names
# (e.g. X-Forwarded-Proto). That proxy must set the header itself, overwriting a client's.
SECURE_CONTENT_TYPE_NOSNIFF = True
X_FRAME_OPTIONS = "DENY"
SESSION_COOKIE_SECURE = PRODUCTION
CSRF_COOKIE_SECURE = PRODUCTION
_proxy_ssl_header = env_str("FEDINFER_PROXY_SSL_HEADER", "")
if _proxy_ssl_header:
    if not re.fullmatch(r"[A-Za-z0-9-]+", _proxy_ssl_header):
        raise ImproperlyConfiguredEnv(
            f"FEDINFER_PROXY_SSL_HEADER={_proxy_ssl_header!r} is not a header name "
            "(e.g. X-Forwarded-Proto)"
        )
    SECURE_PROXY_SSL_HEADER = ("HTTP_" + _proxy_ssl_header.upper().replace("-", "_"), "https")
# Redirect http:// to https://. On by default in production when the proxy header tells an
# HTTPS request apart (without it every request would look like http:// and redirect forever).
SECURE_SSL_REDIRECT = env_bool("FEDINFER_SSL_REDIRECT", PRODUCTION and bool(_proxy_ssl_header))
# Probes and Prometheus reach each web process directly, past the TLS proxy, over plain HTTP.
SECURE_REDIRECT_EXEMPT = [r"^healthz$", r"^readyz$", r"^metrics$"]
SECURE_HSTS_SECONDS = env_int("FEDINFER_HSTS_SECONDS", 365 * 24 * 3600) if PRODUCTION else 0
SECURE_HSTS_INCLUDE_SUBDOMAINS = env_bool("FEDINFER_HSTS_INCLUDE_SUBDOMAINS", True)
SECURE_HSTS_PRELOAD = env_bool("FEDINFER_HSTS_PRELOAD", False)
SILENCED_SYSTEM_CHECKS = []
if not SECURE_HSTS_PRELOAD:
    # security.W021 (no HSTS preload): preloading is a commitment for a whole registrable
    # domain, made at its apex and hard to undo, not a setting one service picks; the
    # operator opts in with FEDINFER_HSTS_PRELOAD=true.
    SILENCED_SYSTEM_CHECKS.append("security.W021")

#: Hours an API token from POST /api/v1/auth/token/ stays valid.
FEDINFER_TOKEN_TTL_HOURS = env_int("FEDINFER_TOKEN_TTL_HOURS", 24)
if FEDINFER_TOKEN_TTL_HOURS < 1:
    raise ImproperlyConfiguredEnv("FEDINFER_TOKEN_TTL_HOURS must be at least 1")

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "federation.tenancy.api.authentication.TokenAuthentication",
        "rest_framework.authentication.SessionAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["federation.api.permissions.IsStaffOrReadOnlyScoped"],
    "DEFAULT_FILTER_BACKENDS": [
        "django_filters.rest_framework.DjangoFilterBackend",
        "rest_framework.filters.OrderingFilter",
    ],
    "DEFAULT_PAGINATION_CLASS": "federation.api.pagination.Pagination",
    "PAGE_SIZE": 50,
    "DEFAULT_SCHEMA_CLASS": "federation.api.schema.AutoSchema",
    "EXCEPTION_HANDLER": "federation.api.errors.exception_handler",
    "DEFAULT_PARSER_CLASSES": ["federation.api.parsers.JSONParser"],
    "TEST_REQUEST_DEFAULT_FORMAT": "json",
    # For any DRF throttle: None would key on the whole X-Forwarded-For, which clients write.
    "NUM_PROXIES": FEDINFER_TRUSTED_PROXIES,
}

SPECTACULAR_SETTINGS = {
    "TITLE": "fedinfer management API",
    "DESCRIPTION": (
        "Regions, GPU pools, models, deployments, instances, edges, tenants and API keys."
    ),
    "VERSION": "1.0.0",
    "SERVE_INCLUDE_SCHEMA": False,
    "COMPONENT_SPLIT_REQUEST": True,
    "SCHEMA_PATH_PREFIX": r"/api/v1",
    # Choice sets that share a field name (status, role) or a set (jurisdictions) get one
    # stable component name each instead of a hash suffix.
    "ENUM_NAME_OVERRIDES": {
        "JurisdictionEnum": "federation.inventory.models.Jurisdiction",
        "RegionStatusEnum": "federation.inventory.models.Region.Status",
        "PoolStatusEnum": "federation.inventory.models.GPUPool.Status",
        "DeploymentRoleEnum": "federation.inventory.models.Deployment.Role",
        "MembershipRoleEnum": "federation.tenancy.models.Membership.Role",
        "ApiKeyStatusEnum": ["active", "revoked", "expired"],
    },
    # Swagger UI assets are served by us, not a CDN: consoles often run air-gapped.
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "REDOC_DIST": "SIDECAR",
}

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "root": {"handlers": ["console"], "level": env_str("FEDINFER_LOG_LEVEL", "INFO")},
    # httpx logs every request at INFO: too chatty for probes and table sync.
    "loggers": {"httpx": {"level": "WARNING"}, "httpcore": {"level": "WARNING"}},
}
