"""``fedinfer edge``: one region's edge router under uvicorn (uvloop + httptools)."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from regions.edge.app import Edge, EdgeConfig
from regions.edge.health import HealthConfig
from regions.edge.scheduler import POLICIES, SchedulerConfig
from regions.edge.table import TableError, check_successor, decode_table


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fedinfer edge", description=__doc__)
    p.add_argument("--region", required=True, help="region code this edge serves")
    p.add_argument("--table", required=True, type=Path, help="routing-table JSON document")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--policy", choices=POLICIES, default="fedinfer")
    p.add_argument("--max-body-bytes", type=int, default=4 * 1024 * 1024)
    p.add_argument("--queue-size", type=int, default=256, help="requests waiting for capacity")
    p.add_argument("--queue-timeout", type=float, default=5.0, help="seconds a request may wait")
    p.add_argument(
        "--max-retries", type=int, default=2, help="other instances tried before byte one"
    )
    p.add_argument("--connect-timeout", type=float, default=2.0)
    p.add_argument("--read-timeout", type=float, default=300.0)
    p.add_argument("--probe-interval", type=float, default=1.0)
    p.add_argument("--scrape-interval", type=float, default=0.5)
    p.add_argument("--table-poll", type=float, default=1.0, help="seconds between file checks")
    p.add_argument("--eject-after", type=int, default=3, help="consecutive failures to eject")
    p.add_argument("--readmit-after", type=int, default=2, help="consecutive successes to readmit")
    p.add_argument("--backoff-base", type=float, default=1.0, help="first ejection, seconds")
    p.add_argument("--affinity-factor", type=float, default=1.5)
    p.add_argument("--affinity-margin-ms", type=float, default=50.0)
    p.add_argument("--decode-slowdown", type=float, default=1.0)
    p.add_argument("--bytes-per-token", type=float, default=4.0)
    p.add_argument("--prefix-capacity", type=int, default=200_000, help="block hashes kept")
    p.add_argument("--log-level", default="info")
    return p


def config_from_args(opts: argparse.Namespace) -> EdgeConfig:
    return EdgeConfig(
        region=opts.region,
        table_path=opts.table,
        scheduler=SchedulerConfig(
            policy=opts.policy,
            affinity_factor=opts.affinity_factor,
            affinity_margin_s=opts.affinity_margin_ms / 1000.0,
            decode_slowdown=opts.decode_slowdown,
        ),
        health=HealthConfig(
            eject_after=opts.eject_after,
            readmit_after=opts.readmit_after,
            backoff_base_s=opts.backoff_base,
        ),
        max_body_bytes=opts.max_body_bytes,
        queue_size=opts.queue_size,
        queue_timeout_s=opts.queue_timeout,
        max_retries=opts.max_retries,
        connect_timeout_s=opts.connect_timeout,
        read_timeout_s=opts.read_timeout,
        probe_interval_s=opts.probe_interval,
        scrape_interval_s=opts.scrape_interval,
        table_poll_s=opts.table_poll,
        bytes_per_token=opts.bytes_per_token,
        prefix_capacity=opts.prefix_capacity,
    )


def make_edge(cfg: EdgeConfig) -> Edge:
    """Load the initial table (a bad one stops the edge loudly: there is nothing to serve)."""
    try:
        data = cfg.table_path.read_bytes()
    except OSError as exc:
        raise TableError(f"cannot read routing table {cfg.table_path}: {exc}") from exc
    table = decode_table(data)
    check_successor(None, table, region=cfg.region)
    edge = Edge(cfg, table)
    edge.mark_loaded(data)
    return edge


def main(argv: list[str]) -> None:
    import uvicorn

    opts = build_parser().parse_args(argv)
    logging.basicConfig(
        level=opts.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s %(message)s"
    )
    try:
        edge = make_edge(config_from_args(opts))
    except TableError as exc:
        raise SystemExit(f"fedinfer edge: {exc}") from exc
    uvicorn.run(
        edge,
        host=opts.host,
        port=opts.port,
        loop="uvloop",
        http="httptools",
        lifespan="on",
        access_log=False,
        server_header=False,
        log_level=opts.log_level,
    )
