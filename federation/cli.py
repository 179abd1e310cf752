"""The ``fedinfer`` command: one entry point for every process of the platform.

fedinfer serve        control plane web (REST API, console, admin)
fedinfer worker       Celery worker + beat (--no-beat: the worker alone)
fedinfer beat         Celery beat alone: exactly one per deployment, its workers --no-beat
fedinfer edge         edge router of one region
fedinfer engine-sim   vLLM-compatible engine simulator
fedinfer demo         everything on one machine, embedded defaults
fedinfer <django management command> ...   e.g. migrate, loaddemo, createsuperuser
"""

from __future__ import annotations

import os
import sys


def _django(argv: list[str]) -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "federation.settings")
    from django.core.management import execute_from_command_line

    execute_from_command_line(["fedinfer", *argv])


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    command = args[0] if args else "help"
    if command == "serve":
        _serve(args[1:])
    elif command == "worker":
        _worker(args[1:])
    elif command == "beat":
        _beat(args[1:])
    elif command in {"engine-sim", "edge"}:
        # The region's processes never import Django (import-linter enforces it).
        from regions.cli import main as region_main

        region_main(args)
    elif command in {"help", "-h", "--help"}:
        print(__doc__)
    else:
        _django(args)


def _serve(args: list[str]) -> None:
    import argparse

    import uvicorn

    parser = argparse.ArgumentParser(prog="fedinfer serve")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--no-migrate", action="store_true", help="do not apply migrations first")
    opts = parser.parse_args(args)
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "federation.settings")
    if not opts.no_migrate:
        _django(["migrate", "--noinput"])
    uvicorn.run(
        "federation.asgi:application",
        host=opts.host,
        port=opts.port,
        workers=opts.workers,
        lifespan="off",
        # uvicorn would replace the peer address with X-Forwarded-For (and the scheme with
        # X-Forwarded-Proto) for loopback peers; which proxies to believe is the settings'
        # call (FEDINFER_TRUSTED_PROXIES, FEDINFER_PROXY_SSL_HEADER), not the server's.
        proxy_headers=False,
    )


def _worker(args: list[str]) -> None:
    """Celery worker with beat embedded (unless ``--no-beat``: several workers must not each
    run the schedule); extra arguments go to ``celery worker``."""
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "federation.settings")
    import shutil
    import tempfile

    # The metric samples of the pool and beat processes (workers/metrics.py), set before
    # prometheus_client is imported; a directory of this run's unless the operator chose one.
    samples = None
    if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        samples = os.environ["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp(prefix="fedinfer-")
    from workers.celery import app

    if "--help" in args:
        print("fedinfer worker [--no-beat] [celery worker options below]")
        print("  --no-beat  without the embedded beat: run exactly one `fedinfer beat` then\n")
    beat = [] if "--no-beat" in args else ["--beat"]
    rest = [a for a in args if a != "--no-beat"]
    try:
        app.worker_main(["worker", *beat, "--loglevel", "INFO", *rest])
    finally:
        if samples is not None:
            shutil.rmtree(samples, ignore_errors=True)


def _beat(args: list[str]) -> None:
    """Celery beat on its own, for workers started ``--no-beat``; extra arguments go to
    ``celery beat``. Run exactly one: two would queue every periodic task twice."""
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "federation.settings")
    from workers.celery import app

    app.start(["beat", "--loglevel", "INFO", *args])


if __name__ == "__main__":
    main()
