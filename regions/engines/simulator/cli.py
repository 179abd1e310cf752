"""``fedinfer engine-sim``: N simulated vLLM engines on ports P..P+N-1 of one process.

One asyncio loop (uvloop) runs every engine's step loop and one uvicorn server per engine, so
a handful of engines costs one process and no threads. Each engine prints a line
``engine-sim: engine I listening on http://HOST:PORT ...`` once it accepts connections;
``--port 0`` lets the OS pick free ports (tests), reported there and in ``--ready-file``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import signal
import socket
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import uvicorn

from regions.engines.accelerators import ACCELERATOR_ALIASES, ACCELERATORS
from regions.engines.prompt_tokens import ModelTokenizer, TokenizerError
from regions.engines.simulator.engine import EngineConfig, SimEngine
from regions.engines.simulator.faults import FaultConfig, apply_update, parse_fault_flag
from regions.engines.simulator.http import CUT_FILTER
from regions.engines.simulator.kv_events import (
    KVEventPublisher,
    KVEventsConfig,
    parse_kv_events_config,
)
from regions.engines.simulator.kv_transfer import KV_ROLES, KVTransferConfig
from regions.engines.simulator.server import EngineApp
from regions.engines.simulator.tokenizer import OutputPlanner, Tokenizer

log = logging.getLogger("fedinfer.engine_sim")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="fedinfer engine-sim",
        description="Simulated vLLM engines (OpenAI-compatible API, vLLM metrics, a vLLM v1 "
        "performance model).",
    )
    p.add_argument("--count", type=int, default=1, help="engines to host (default 1)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument(
        "--port", type=int, default=8000, help="port of engine 0; engine i gets port+i (0: any)"
    )
    p.add_argument("--model", default="meta-llama/Llama-3.1-8B-Instruct")
    p.add_argument("--served-model-name", nargs="+", default=None)
    p.add_argument(
        "--accelerator", default="H100-80G", choices=sorted([*ACCELERATORS, *ACCELERATOR_ALIASES])
    )
    p.add_argument("--tp", "--tensor-parallel-size", dest="tp", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--num-gpu-blocks", type=int, default=None, help="default: what fits")
    p.add_argument("--max-model-len", type=int, default=None, help="default: min(32768, KV)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-loras", type=int, default=4, help="adapters per batch; 0: no LoRA")
    p.add_argument(
        "--lora-modules", nargs="+", default=[], metavar="NAME=PATH", help="adapters at start"
    )
    p.add_argument("--no-enable-prefix-caching", action="store_true")
    p.add_argument(
        "--prefix-caching-hash-algo",
        default="sha256",
        choices=("sha256", "sha256_cbor", "xxhash", "xxhash_cbor"),
        help="as in vLLM; sha256_cbor hashes blocks exactly as vLLM does (the others: the "
        "simulator's own hash, which no router reproduces)",
    )
    p.add_argument(
        "--tokenizer",
        type=Path,
        default=None,
        help="a model's tokenizer.json or its directory (with tokenizer_config.json's chat "
        "template): prompts are tokenized with it, as vLLM would (default: the built-in one)",
    )
    p.add_argument("--output-len-median", type=int, default=128)
    p.add_argument("--params-billion", type=float, default=None, help="default: from --model")
    p.add_argument("--zero-latency", action="store_true", help="answer at once (overhead tests)")
    p.add_argument(
        "--fault",
        action="append",
        default=[],
        metavar="[ENGINE:]KEY=VALUE[,...]",
        help="e.g. error_rate=0.1 | 1:latency_ms=200 | health_fail | die_after_tokens=5 | "
        "hang_rate=1 | kill_after_s=3",
    )
    p.add_argument(
        "--kv-role",
        default="kv_both",
        choices=[*KV_ROLES, "none"],
        help="KV connector role for P/D disaggregation (kv_transfer_params); none: ignore them",
    )
    p.add_argument(
        "--kv-hold-s", type=float, default=480.0, help="held prefill blocks wait this long"
    )
    p.add_argument("--kv-bandwidth-gb-s", type=float, default=25.0, help="KV transfer link, GB/s")
    p.add_argument(
        "--kv-events-config",
        type=_kv_events_config,
        default=KVEventsConfig(),
        metavar="JSON",
        help='as in vLLM, e.g. \'{"enable_kv_cache_events": true, "publisher": "zmq", '
        '"endpoint": "tcp://[::ffff:127.0.0.1]:5557", "topic": "kv-events"}\'; engine i: '
        "port+i (0: any); a wildcard tcp://*:PORT binds on --host only",
    )
    p.add_argument("--ready-file", type=Path, default=None, help="write engine URLs as JSON")
    p.add_argument("--log-level", default="warning")
    return p


def _kv_events_config(text: str) -> KVEventsConfig:
    try:
        return parse_kv_events_config(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def kv_event_publishers(
    config: KVEventsConfig, engines: list[SimEngine], host: str
) -> list[KVEventPublisher]:
    """One publisher per engine (engine i on the endpoint's port + i), attached to it; a
    wildcard endpoint binds on ``host`` only; the address subscribers connect to is
    ``advertised``."""
    if not config.enabled:
        return []
    publishers = []
    try:
        for engine in engines:
            publisher = KVEventPublisher(config, engine.index, host=host)
            publishers.append(publisher)
            engine.publish_kv_events(publisher)
    except Exception as exc:
        for publisher in publishers:
            publisher.close()
        raise SystemExit(f"engine-sim: cannot publish KV events: {exc}") from None
    return publishers


def advertised(publisher: KVEventPublisher, host: str) -> str:
    """The endpoint a subscriber connects to: a wildcard bind is reached at ``host``."""
    endpoint = publisher.endpoint
    if endpoint.startswith("tcp://0.0.0.0:") or endpoint.startswith("tcp://[::]:"):
        return f"tcp://{host}:{publisher.port}"
    return endpoint


def engine_configs(args: argparse.Namespace) -> list[EngineConfig]:
    """One config per engine (faults may differ); ``ValueError`` on bad input."""
    if args.count < 1:
        raise ValueError("--count must be at least 1")
    loras = []
    for spec in args.lora_modules:
        name, eq, path = spec.partition("=")
        if not eq or not name or not path:
            raise ValueError(f"--lora-modules expects NAME=PATH, got {spec!r}")
        loras.append((name, path))
    if args.kv_hold_s <= 0 or args.kv_bandwidth_gb_s <= 0:
        raise ValueError("--kv-hold-s and --kv-bandwidth-gb-s must be positive")
    kv = KVTransferConfig(
        role=None if args.kv_role == "none" else args.kv_role,
        hold_s=args.kv_hold_s,
        bandwidth_bytes_per_s=args.kv_bandwidth_gb_s * 1e9,
    )
    faults = [FaultConfig() for _ in range(args.count)]
    for spec in args.fault:
        index, update = parse_fault_flag(spec)
        if index is not None and not 0 <= index < args.count:
            raise ValueError(f"--fault {spec!r}: no engine {index}")
        for i in range(args.count) if index is None else (index,):
            faults[i] = apply_update(faults[i], update)
    return [
        EngineConfig(
            model=args.model,
            served_model_names=tuple(args.served_model_name or ()),
            accelerator=args.accelerator,
            tp=args.tp,
            seed=args.seed,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            num_gpu_blocks=args.num_gpu_blocks,
            max_model_len=args.max_model_len,
            block_size=args.block_size,
            max_loras=args.max_loras,
            enable_prefix_caching=not args.no_enable_prefix_caching,
            zero_latency=args.zero_latency,
            output_len_median=args.output_len_median,
            params_billion=args.params_billion,
            lora_modules=tuple(loras),
            prefix_caching_hash_algo=args.prefix_caching_hash_algo,
            faults=faults[i],
            kv_transfer=kv,
        )
        for i in range(args.count)
    ]


class _Server(uvicorn.Server):
    """A uvicorn server that leaves signals to the process (several share one loop)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise SystemExit(f"engine-sim: cannot listen on {host}:{port}: {exc}") from None
    sock.listen(2048)
    sock.setblocking(False)
    return sock


def _prompt_tokenizer(path: Path | None) -> ModelTokenizer | None:
    if path is None:
        return None
    try:
        # No cut: the simulator's own limits (max_model_len) bound what it tokenizes.
        return ModelTokenizer(path, max_chars=1 << 30)
    except (OSError, TokenizerError) as exc:
        raise SystemExit(f"engine-sim: --tokenizer {path}: {exc}") from None


def build_engines(
    configs: list[EngineConfig], prompt_tokenizer: ModelTokenizer | None = None
) -> list[SimEngine]:
    """The engines, sharing a tokenizer and (same seed, same median) an answer planner."""
    tokenizer = Tokenizer()
    planners: dict[tuple[int, int], OutputPlanner] = {}
    engines = []
    for i, cfg in enumerate(configs):
        key = (cfg.seed, cfg.output_len_median)
        if key not in planners:
            planners[key] = OutputPlanner(tokenizer, cfg.seed, cfg.output_len_median)
        engines.append(SimEngine(cfg, i, tokenizer, planners[key], prompt_tokenizer))
    return engines


async def serve(args: argparse.Namespace, engines: list[SimEngine]) -> None:
    """Run the engines and one HTTP server each until a signal (or every engine's kill),
    then close everything."""
    sockets = [_bind(args.host, args.port + i if args.port else 0) for i in range(len(engines))]
    publishers = kv_event_publishers(args.kv_events_config, engines, args.host)
    engine_tasks = [asyncio.ensure_future(engine.run()) for engine in engines]
    servers = _servers(engines, args.log_level)
    logging.getLogger("uvicorn.error").addFilter(CUT_FILTER)
    _stop_on_signals(servers)
    server_tasks = [
        asyncio.ensure_future(server.serve(sockets=[sock]))
        for server, sock in zip(servers, sockets, strict=True)
    ]
    await _until_started(servers, server_tasks)
    _announce(engines, sockets, args.host, args.ready_file)
    try:
        await asyncio.gather(*server_tasks)
    finally:
        await _shut_down(engines, engine_tasks, sockets, publishers)


def _servers(engines: list[SimEngine], log_level: str) -> list[_Server]:
    """One uvicorn server per engine, not yet serving; a ``kill_after_s`` fault is armed."""
    loop = asyncio.get_running_loop()
    servers = []
    for engine in engines:
        app = EngineApp(engine)
        config = uvicorn.Config(
            app,
            loop="none",
            http="httptools",
            lifespan="off",
            access_log=False,
            log_level=log_level,
            timeout_graceful_shutdown=2,
            timeout_keep_alive=30,
            backlog=2048,
        )
        server = _Server(config)
        app.on_kill = _stopper(server)
        servers.append(server)
        if engine.config.faults.kill_after_s is not None:
            loop.call_later(engine.config.faults.kill_after_s, app.kill)
    return servers


def _stop_on_signals(servers: list[_Server]) -> None:
    """SIGINT and SIGTERM stop every server (``serve`` then closes the engines)."""

    def stop() -> None:
        for server in servers:
            server.should_exit = True

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop)


async def _until_started(servers: list[_Server], tasks: list[asyncio.Task[None]]) -> None:
    """Every server up within 5 s, or stop waiting (one that failed has ended its task)."""
    for _ in range(500):
        if all(s.started for s in servers) or any(t.done() for t in tasks):
            return
        await asyncio.sleep(0.01)


def _announce(
    engines: list[SimEngine], sockets: list[socket.socket], host: str, ready_file: Path | None
) -> None:
    """Give each engine its own address (its KV side channel), print its listening line and
    write the ready-file."""
    ready = []
    for engine, sock in zip(engines, sockets, strict=True):
        port: int = sock.getsockname()[1]
        engine.side_channel = (host, port)
        ready.append(_announce_engine(engine, host, port))
    if ready_file is not None:
        ready_file.write_text(json.dumps({"engines": ready}))


def _announce_engine(engine: SimEngine, host: str, port: int) -> dict[str, object]:
    """Print the engine's ``listening on`` line; its ready-file entry."""
    url = f"http://{host}:{port}"
    entry: dict[str, object] = {"index": engine.index, "url": url, "port": port}
    events = ""
    if engine.kv_events is not None:
        entry["kv_events_endpoint"] = advertised(engine.kv_events, host)
        events = f" kv_events={entry['kv_events_endpoint']}"
    print(
        f"engine-sim: engine {engine.index} listening on {url} "
        f"model={engine.served_model_names[0]} accelerator={engine.config.accelerator} "
        f"tp={engine.config.tp} num_gpu_blocks={engine.num_gpu_blocks} "
        f"max_model_len={engine.max_model_len}"
        + (" zero-latency" if engine.config.zero_latency else "")
        + events,
        flush=True,
    )
    return entry


async def _shut_down(
    engines: list[SimEngine],
    engine_tasks: list[asyncio.Task[None]],
    sockets: list[socket.socket],
    publishers: list[KVEventPublisher],
) -> None:
    for engine in engines:
        await engine.aclose()
    for task in engine_tasks:
        task.cancel()
    await asyncio.gather(*engine_tasks, return_exceptions=True)
    for sock in sockets:
        sock.close()
    for publisher in publishers:
        publisher.close()


def _stopper(server: _Server) -> Callable[[], None]:
    def stop() -> None:
        server.should_exit = True

    return stop


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s %(message)s")
    try:
        # An impossible configuration fails here, before anything is bound.
        engines = build_engines(engine_configs(args), _prompt_tokenizer(args.tokenizer))
    except ValueError as exc:
        raise SystemExit(f"engine-sim: {exc}") from None
    import uvloop

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(serve(args, engines))
    sys.stdout.flush()
