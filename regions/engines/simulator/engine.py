"""One simulated engine: the pure scheduler driven in real time on asyncio.

The loop plans a step, sleeps for the step time the performance model gives (minus the time
the planning took), applies the step and wakes the request handlers whose requests produced a
token. Requests that arrive during a step join the next one, as in vLLM. With
``zero_latency`` there is no loop: a request is answered at once with its planned output, for
measuring a router's own overhead.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import httpx
import xxhash

from regions.engines.accelerators import accelerator
from regions.engines.block_hash import DEFAULT_SEED, HASH_ALGO, none_hash
from regions.engines.prompt_tokens import ModelTokenizer
from regions.engines.simulator.faults import FaultConfig, FaultInjector
from regions.engines.simulator.kv_cache import KVCacheManager, root_hash
from regions.engines.simulator.kv_events import KVEventPublisher
from regions.engines.simulator.kv_transfer import (
    KVTransferConfig,
    KVTransferError,
    producer_params,
    read_remote,
)
from regions.engines.simulator.perf import PerfModel, model_params_billion
from regions.engines.simulator.prom import EngineMetrics
from regions.engines.simulator.scheduler import (
    Request,
    Scheduler,
    SchedulerConfig,
    Status,
    StepPlan,
    StepResult,
)
from regions.engines.simulator.tokenizer import OutputPlanner, Tokenizer, tokens_digest

log = logging.getLogger("fedinfer.engine_sim")

#: The vLLM release whose API, metrics and fingerprint the simulator reproduces.
VLLM_VERSION = "0.32.0"
DEFAULT_MAX_MODEL_LEN = 32768


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: str = "meta-llama/Llama-3.1-8B-Instruct"
    served_model_names: tuple[str, ...] = ()
    accelerator: str = "H100-80G"
    tp: int = 1
    seed: int = 0
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    num_gpu_blocks: int | None = None
    max_model_len: int | None = None
    block_size: int = 16
    max_loras: int = 4
    enable_prefix_caching: bool = True
    zero_latency: bool = False
    #: Median length of an answer when the model "stops by itself" (log-normal, sigma 0.7).
    output_len_median: int = 128
    params_billion: float | None = None
    lora_modules: tuple[tuple[str, str], ...] = ()
    #: vLLM's ``--prefix-caching-hash-algo``: ``sha256_cbor`` hashes blocks exactly as vLLM
    #: does (``regions/engines/block_hash.py``, what the edge reproduces); the others stand
    #: for hashes no router can reproduce, computed with the simulator's own 64-bit hash.
    prefix_caching_hash_algo: str = "sha256"
    faults: FaultConfig = field(default_factory=FaultConfig)
    kv_transfer: KVTransferConfig = field(default_factory=KVTransferConfig)


class RequestStream:
    """Hand-off between the engine loop and the HTTP handler of one request."""

    __slots__ = ("_waiter", "cut", "last_token_time", "request", "texts")

    def __init__(self, request: Request, texts: list[str]):
        self.request = request
        self.texts = texts
        self.cut = False  # the engine was killed: end the response without finishing it
        self.last_token_time: float | None = None
        self._waiter: asyncio.Future[None] | None = None

    @property
    def finished(self) -> bool:
        return self.request.status is Status.FINISHED

    def notify(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def wait(self) -> None:
        """Until the engine reports progress (new tokens, finish, cut)."""
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None


class ModelNotFound(Exception):
    pass


def _vllm_root(algo: str) -> bytes | None:
    """vLLM's ``NONE_HASH`` for ``sha256_cbor`` (from ``PYTHONHASHSEED`` when set, as vLLM
    does), None for the simulator's own hash."""
    if algo != HASH_ALGO:
        return None
    return none_hash(os.environ.get("PYTHONHASHSEED", DEFAULT_SEED))


class SimEngine:
    def __init__(
        self,
        config: EngineConfig,
        index: int = 0,
        tokenizer: Tokenizer | None = None,
        planner: OutputPlanner | None = None,
        prompt_tokenizer: ModelTokenizer | None = None,
    ):
        self.config = config
        self.index = index
        self.tokenizer = tokenizer or Tokenizer()
        #: A real model's tokenizer (``--tokenizer``): prompts are tokenized with it, as vLLM
        #: would; answers stay the simulator's own text and ids.
        self.prompt_tokenizer = prompt_tokenizer
        self.served_model_names = config.served_model_names or (config.model,)
        params = config.params_billion or model_params_billion(config.model)
        self.perf = PerfModel(accelerator(config.accelerator), config.tp, params)
        bs = config.block_size
        self.num_gpu_blocks = config.num_gpu_blocks or self.perf.default_num_gpu_blocks(bs)
        self.max_model_len = config.max_model_len or min(
            DEFAULT_MAX_MODEL_LEN, self.num_gpu_blocks * bs
        )
        self.kv = KVCacheManager(self.num_gpu_blocks, bs, config.enable_prefix_caching)
        self.loras: dict[str, str] = dict(config.lora_modules)
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_model_len=self.max_model_len,
                block_size=bs,
                max_loras=config.max_loras,
            ),
            self.kv,
            root_hash(config.seed),
            _vllm_root(config.prefix_caching_hash_algo),
            self.loras,
        )
        self.metrics = EngineMetrics(
            self.served_model_names[0],
            self.max_model_len,
            _cache_config_info(config, self.num_gpu_blocks),
            config.max_loras,
        )
        self.faults = FaultInjector(config.seed * 7919 + index, config.faults)
        self.streams: dict[str, RequestStream] = {}
        self.created = int(time.time())
        self.system_fingerprint = _system_fingerprint(
            config, self.max_model_len, self.num_gpu_blocks
        )
        self.killed = False
        self.killed_event = asyncio.Event()
        #: NixlConnector's engine id (a fresh one per start: a restarted engine holds nothing).
        self.engine_id = str(uuid.uuid4())
        #: Where decode engines read this engine's blocks: its own HTTP address, set once bound.
        self.side_channel: tuple[str, int] = ("127.0.0.1", 0)
        self._kv_client: httpx.AsyncClient | None = None
        #: Publishes this engine's KV-cache events, when enabled (``publish_kv_events``).
        self.kv_events: KVEventPublisher | None = None
        self._ids = itertools.count()
        self._wake = asyncio.Event()
        self._closed = False
        self.planner = planner or OutputPlanner(
            self.tokenizer, config.seed, config.output_len_median
        )

    # -- model names --------------------------------------------------------------------

    def resolve_model(self, name: str | None) -> str | None:
        """The LoRA adapter a request's ``model`` names (None for the base model)."""
        if not name or name in self.served_model_names:
            return None
        if name in self.loras:
            return name
        raise ModelNotFound(name)

    def load_lora(self, name: str, path: str) -> None:
        self.loras[name] = path

    # -- requests -----------------------------------------------------------------------

    def new_request(
        self,
        prompt_token_ids: list[int],
        max_tokens: int,
        *,
        lora: str | None = None,
        ignore_eos: bool = False,
        min_tokens: int = 0,
        cache_salt: str | None = None,
    ) -> tuple[Request, list[str]]:
        """A request and its planned output: same prompt, same answer (greedy-like), and the
        answer's natural length is log-normal around ``output_len_median``."""
        ids, texts = self.planner.plan(
            tokens_digest(prompt_token_ids),
            max_tokens,
            ignore_eos=ignore_eos,
            min_tokens=min_tokens,
        )
        request = Request(
            request_id=f"{self.index}-{next(self._ids)}",
            prompt_token_ids=prompt_token_ids,
            planned_output_ids=ids,
            max_tokens=max_tokens,
            lora=lora,
            cache_salt=cache_salt,
            arrival_time=time.monotonic(),
        )
        return request, texts

    def submit(self, request: Request, texts: list[str]) -> RequestStream:
        stream = RequestStream(request, texts)
        if self.config.zero_latency:
            self._complete_now(request)
            return stream
        self.scheduler.add_request(request)
        self.streams[request.request_id] = stream
        self._wake.set()
        return stream

    # -- P/D disaggregation (kv_transfer.py) -------------------------------------------------

    def transfer_params(self, request: Request) -> dict[str, Any] | None:
        """The ``kv_transfer_params`` a finished prefill leg answers with (None: nothing held,
        e.g. it stopped before ``max_tokens``, as vLLM's connector returns nothing then)."""
        held = self.scheduler.held.get(request.request_id)
        if held is None:
            return None
        host, port = self.side_channel
        return producer_params(
            self.engine_id, request.request_id, held[0], host, port, self.config.tp
        )

    def read_held(self, engine_id: object, request_id: object) -> int | None:
        """A decode engine reads a held prefill: release it; the prompt tokens it held."""
        if engine_id != self.engine_id or not isinstance(request_id, str):
            return None
        return self.scheduler.release_held(request_id)

    async def load_remote_kv(self, params: dict[str, Any]) -> int:
        """Decode leg: read the prefill engine's blocks and wait the transfer time for their
        size; the prompt tokens now in place (0 after a failed read: computed locally)."""
        cfg = self.config.kv_transfer
        if self._kv_client is None:
            self._kv_client = httpx.AsyncClient()
        try:
            tokens = await read_remote(self._kv_client, params, cfg.read_timeout_s)
        except KVTransferError as exc:
            log.info("KV transfer failed, recomputing the prompt: %s", exc)
            self.scheduler.counters.kv_transfer_failures += 1
            return 0
        await asyncio.sleep(cfg.transfer_time(tokens, self.perf.kv_bytes_per_token()))
        return tokens

    def _complete_now(self, request: Request) -> None:
        counters = self.scheduler.counters
        n = len(request.planned_output_ids)
        request.output_token_ids = request.planned_output_ids
        request.num_tokens += n
        request.num_cached_tokens = 0
        request.status = Status.FINISHED
        request.finish_reason = "length" if n >= request.max_tokens else "stop"
        counters.prompt_tokens += request.num_prompt_tokens
        counters.generation_tokens += n
        self.metrics.success[request.finish_reason].inc()

    def abort(self, request_id: str) -> None:
        """The client went away: free the request's blocks, count it as aborted."""
        now = time.monotonic()
        request = self.scheduler.abort(request_id, now)
        stream = self.streams.pop(request_id, None)
        if request is not None:
            self._record_finished(request, now)
        if stream is not None:
            stream.notify()

    # -- the loop -----------------------------------------------------------------------

    async def run(self) -> None:
        scheduler = self.scheduler
        clock = time.monotonic
        # Steps are laid end to end on a precise clock: a step starts when the previous one was
        # due to end, so the simulator's own CPU time (applying a step, waking handlers, writing
        # chunks) and the event loop's millisecond timer rounding are absorbed by the next
        # sleep instead of stretching or shrinking the modelled step times. Only when the
        # process falls behind by more than 2 ms does the timeline restart from now.
        step_start = clock()
        while not self._closed:
            if not scheduler.has_work():
                self._wake.clear()
                await self._wake.wait()
                step_start = clock()
                continue
            plan = scheduler.schedule(clock())
            if plan.empty:
                # Only possible when every waiting request is blocked (e.g. LoRA slots); wait
                # for a change rather than spin.
                self._wake.clear()
                await self._wake.wait()
                step_start = clock()
                continue
            step_end = step_start + self.perf.plan_time(plan)
            delay = step_end - clock()
            await asyncio.sleep(delay if delay > 0 else 0)
            now = clock()
            step_start = step_end if now - step_end < 0.002 else now
            self._deliver(plan, scheduler.update(plan, now), now)

    def _deliver(self, plan: StepPlan, result: StepResult, now: float) -> None:
        """A computed step's effects outside the scheduler: KV events and metrics published,
        handlers woken for their new tokens, finished requests recorded."""
        if self.kv_events is not None:
            self.kv_events.flush()  # one batch per step, as vLLM publishes them
        self.metrics.iteration_tokens.observe(plan.num_scheduled_tokens)
        ttft = self.metrics.ttft.observe
        itl = self.metrics.itl.observe
        streams = self.streams
        for request in result.first_tokens:
            ttft(now - request.arrival_time)
        for request in result.sampled:
            stream = streams.get(request.request_id)
            if stream is None:
                continue
            if stream.last_token_time is not None:
                itl(now - stream.last_token_time)
            stream.last_token_time = now
            stream.notify()
        held = self.scheduler.held
        for request in result.finished:
            streams.pop(request.request_id, None)
            self._record_finished(request, now)
            if request.request_id in held:
                # Nobody came for the blocks: free them, as vLLM's abort timeout does.
                asyncio.get_running_loop().call_later(
                    self.config.kv_transfer.hold_s,
                    self.scheduler.release_held,
                    request.request_id,
                )

    def _record_finished(self, request: Request, now: float) -> None:
        self.metrics.record_finished(
            request.finish_reason or "abort",
            arrival=request.arrival_time,
            first_scheduled=request.first_scheduled_time,
            first_token=request.first_token_time,
            finished=now,
            prompt_tokens=request.num_prompt_tokens,
            generation_tokens=len(request.output_token_ids),
            max_tokens=request.max_tokens,
        )

    def publish_kv_events(self, publisher: KVEventPublisher) -> None:
        """Report the cache's stored/removed/cleared blocks to ``publisher``."""
        self.kv_events = publisher
        self.kv.listener = publisher

    def kill(self) -> None:
        """Die: cut every open response and stop the loop (the server stops listening)."""
        self.killed = True
        self.killed_event.set()
        self._closed = True
        for request_id, stream in list(self.streams.items()):
            stream.cut = True
            self.scheduler.abort(request_id, time.monotonic())
            stream.notify()
        self.streams.clear()
        self._wake.set()

    def close(self) -> None:
        self._closed = True
        self._wake.set()

    async def aclose(self) -> None:
        """Close, and the side-channel client with it."""
        self.close()
        if self._kv_client is not None:
            await self._kv_client.aclose()

    # -- observation --------------------------------------------------------------------

    def metrics_text(self) -> bytes:
        scheduler = self.scheduler
        self.metrics.refresh(
            scheduler.counters,
            running=scheduler.num_running,
            waiting=scheduler.num_waiting,
            kv_usage=self.kv.usage,
            running_loras=scheduler.running_loras(),
            waiting_loras=scheduler.waiting_loras(),
        )
        return self.metrics.exposition()


def _cache_config_info(config: EngineConfig, num_gpu_blocks: int) -> dict[str, str]:
    """The labels of vLLM's ``vllm:cache_config_info`` for this engine."""
    return {
        "block_size": str(config.block_size),
        "cache_dtype": "auto",
        "enable_prefix_caching": str(config.enable_prefix_caching),
        "gpu_memory_utilization": "0.9",
        "num_cpu_blocks": "None",
        "num_gpu_blocks": str(num_gpu_blocks),
        "num_gpu_blocks_override": str(config.num_gpu_blocks),
        "prefix_caching_hash_algo": "xxhash",
        "sliding_window": "None",
    }


def _system_fingerprint(config: EngineConfig, max_model_len: int, num_gpu_blocks: int) -> str:
    """Stable for one configuration, different across them, as clients see vLLM's."""
    digest = xxhash.xxh64_hexdigest(
        f"{config.model}|{config.accelerator}|{config.tp}|{max_model_len}|"
        f"{num_gpu_blocks}|{config.seed}".encode()
    )
    tp = f"-tp{config.tp}" if config.tp > 1 else ""
    return f"vllm-{VLLM_VERSION}{tp}-{digest[:8]}"
