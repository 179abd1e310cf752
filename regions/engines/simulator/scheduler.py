"""Continuous batching after vLLM v1's ``Scheduler`` (``vllm/v1/core/sched/scheduler.py``).

One call to :meth:`Scheduler.schedule` plans one engine step under a token budget
(``max_num_batched_tokens``): first the running requests in order (decodes cost one token,
unfinished chunked prefills take what the budget leaves), preempting the newest running request
when KV blocks run out; then, if nothing was preempted, waiting requests in FCFS order while
there are seats (``max_num_seqs``), budget and blocks, each first looked up in the prefix
cache and its prefill chunked to fit the budget. :meth:`Scheduler.update` applies the step's
result: computed tokens advance, full blocks enter the prefix cache, each request whose
known tokens are all computed samples one token, and finished requests free their blocks.

Pure: no clock, no I/O; times are passed in. Output tokens are planned when a request is
created (see ``tokenizer.plan_output``), so a run is deterministic given the inputs.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from regions.engines.block_hash import extend_chain
from regions.engines.simulator.kv_cache import KVCacheManager, extend_block_hashes


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


@dataclass(eq=False, slots=True)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    #: The tokens this request will generate (the "model output"), planned up front.
    planned_output_ids: list[int]
    max_tokens: int
    #: Finish with "stop" after the whole plan when it is shorter than ``max_tokens``.
    arrival_time: float = 0.0
    lora: str | None = None
    #: vLLM's ``cache_salt``: its prefix-cache blocks are shared only with the same salt.
    cache_salt: str | None = None
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)
    #: The digests behind ``block_hashes`` when the engine hashes as vLLM's ``sha256_cbor``.
    hash_chain: list[bytes] = field(default_factory=list)
    num_registered_blocks: int = 0
    #: Prompt tokens found in the prefix cache (local or transferred) at first scheduling
    #: (-1 before).
    num_cached_tokens: int = -1
    #: Prompt tokens whose KV arrived from a remote prefill engine (P/D disaggregation): they
    #: count as computed without being computed; used once, at first scheduling.
    num_external_tokens: int = 0
    #: A prefill leg (``do_remote_decode``): when it finishes at ``max_tokens`` its blocks
    #: are held for the decode engine instead of freed (see ``Scheduler.held``).
    hold_on_finish: bool = False
    status: Status = Status.WAITING
    finish_reason: str | None = None
    num_preemptions: int = 0
    #: Prompt plus output tokens so far (kept as a field: read several times per step).
    num_tokens: int = 0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None

    def __post_init__(self) -> None:
        self.num_tokens = len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids


@dataclass(slots=True)
class StepPlan:
    """What one engine step computes; the performance model prices it."""

    scheduled: list[tuple[Request, int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    num_prefill_tokens: int = 0
    #: Sum over prefill chunks of chunk length x attended context (attention is quadratic).
    prefill_attention_pairs: int = 0
    num_decode_seqs: int = 0
    #: Sum of the context lengths the decode sequences attend to (KV bytes read).
    decode_context_tokens: int = 0

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)

    @property
    def empty(self) -> bool:
        return not self.scheduled


@dataclass(slots=True)
class StepResult:
    #: Requests that sampled a token in this step (each exactly one).
    sampled: list[Request] = field(default_factory=list)
    #: Requests whose first token this was.
    first_tokens: list[Request] = field(default_factory=list)
    finished: list[Request] = field(default_factory=list)


@dataclass(slots=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 32768
    block_size: int = 16
    max_loras: int = 4
    enable_chunked_prefill: bool = True


@dataclass(slots=True)
class SchedulerCounters:
    """Monotonic totals, as vLLM's Prometheus counters count them."""

    prefix_cache_queries: int = 0  # tokens looked up (prompt length of new requests)
    prefix_cache_hits: int = 0  # tokens found
    #: Tokens asked of the KV connector (prompt minus local hits) and tokens it provided.
    external_prefix_cache_queries: int = 0
    external_prefix_cache_hits: int = 0
    #: Remote KV reads that failed (the prompt was recomputed).
    kv_transfer_failures: int = 0
    prompt_tokens: int = 0  # prompt length of requests whose prefill finished
    generation_tokens: int = 0
    preemptions: int = 0
    steps: int = 0


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        kv: KVCacheManager,
        root_hash: int,
        vllm_root: bytes | None = None,
        lora_paths: Mapping[str, str] | None = None,
    ):
        """``vllm_root``: hash blocks exactly as vLLM's ``sha256_cbor`` from this
        ``NONE_HASH`` (``regions/engines/block_hash.py``; ``lora_paths`` names each adapter's
        path, part of its blocks' keys), instead of the simulator's own 64-bit hash."""
        if kv.block_size != config.block_size:
            raise ValueError("scheduler and KV cache disagree on the block size")
        if -(-config.max_model_len // kv.block_size) > kv.num_blocks:
            raise ValueError(
                f"max_model_len {config.max_model_len} needs more KV blocks than the "
                f"{kv.num_blocks} available ({kv.num_blocks * kv.block_size} tokens)"
            )
        self.config = config
        self.kv = kv
        self.root_hash = root_hash
        self.vllm_root = vllm_root
        self.lora_paths = lora_paths if lora_paths is not None else {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.counters = SchedulerCounters()
        #: Finished prefill legs' blocks kept for a decode engine: request id -> (block ids,
        #: prompt tokens they hold).
        self.held: dict[str, tuple[list[int], int]] = {}

    # -- requests in and out ---------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        if request.num_prompt_tokens == 0:
            raise ValueError("a request needs at least one prompt token")
        if request.num_prompt_tokens + request.max_tokens > self.config.max_model_len:
            raise ValueError("prompt plus max_tokens exceed max_model_len")
        self._hash(request, request.prompt_token_ids)
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def abort(self, request_id: str, now: float = 0.0) -> Request | None:
        """Stop a request wherever it is (client went away) and free its blocks."""
        request = self.requests.get(request_id)
        if request is None or request.status is Status.FINISHED:
            return None
        if request.status is Status.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self._finish(request, "abort", now)
        return request

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def running_loras(self) -> set[str]:
        return {r.lora for r in self.running if r.lora}

    def waiting_loras(self) -> set[str]:
        return {r.lora for r in self.waiting if r.lora}

    # -- one step ---------------------------------------------------------------------------

    def schedule(self, now: float = 0.0) -> StepPlan:
        """Plan one step: grow the running requests, then admit waiting ones unless that
        growth had to preempt (memory is short: the preempted go first next step)."""
        plan = StepPlan()
        budget = self._grow_running(plan, self.config.max_num_batched_tokens)
        if not plan.preempted:
            self._admit_waiting(plan, budget, now)
        return plan

    def _grow_running(self, plan: StepPlan, budget: int) -> int:
        """Give each running request, oldest first, its next tokens (one to decode, a chunk of
        an unfinished prefill), preempting the newest running requests when KV blocks run
        out; the budget left."""
        max_model_len = self.config.max_model_len
        kv = self.kv
        running = self.running
        i = 0
        while i < len(running) and budget > 0:
            request = running[i]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            num_new = min(num_new, max_model_len - request.num_computed_tokens)
            if num_new <= 0:
                i += 1
                continue
            scheduled = True
            while not kv.allocate(request.block_ids, request.num_computed_tokens, num_new):
                victim = running.pop()  # the newest running request, as vLLM's FCFS policy
                self._preempt(victim)
                plan.preempted.append(victim)
                if victim is request:
                    scheduled = False
                    break
            if not scheduled:
                break
            self._add_to_plan(plan, request, num_new)
            budget -= num_new
            i += 1
        return budget

    def _admit_waiting(self, plan: StepPlan, budget: int, now: float) -> None:
        """Start waiting requests in FCFS order while there are seats, budget and blocks; one
        whose adapter would exceed ``max_loras`` waits, keeping its place in line."""
        cfg = self.config
        running = self.running
        waiting = self.waiting
        loras = {r.lora for r in running if r.lora}
        skipped: list[Request] = []
        while waiting and budget > 0 and len(running) < cfg.max_num_seqs:
            request = waiting[0]
            if request.lora and request.lora not in loras and len(loras) >= cfg.max_loras:
                skipped.append(waiting.popleft())
                continue
            num_new = self._admit(request, budget, now)
            if num_new is None:
                break
            if request.lora:
                loras.add(request.lora)
            self._add_to_plan(plan, request, num_new)
            budget -= num_new
        waiting.extendleft(reversed(skipped))

    def _admit(self, request: Request, budget: int, now: float) -> int | None:
        """Move the first waiting request to running: its cached and transferred prompt
        tokens count as computed, the rest is its prefill (chunked to ``budget``). The tokens
        it computes this step, or None when it does not fit (it stays first in line)."""
        kv = self.kv
        hit, external = self._reusable_prefix(request)
        num_cached = len(hit) * kv.block_size
        num_new = request.num_tokens - request.num_computed_tokens - num_cached - external
        if self.config.enable_chunked_prefill:
            num_new = min(num_new, budget)
        elif num_new > budget:
            return None
        if not kv.allocate(request.block_ids, request.num_computed_tokens, num_new + external, hit):
            return None
        self.waiting.popleft()
        self._count_prefix_lookup(request, num_cached, external)
        # Used once: a preempted request recomputes (the remote blocks are gone).
        request.num_external_tokens = 0
        request.num_computed_tokens += num_cached + external
        request.num_registered_blocks = len(hit)
        if request.first_scheduled_time is None:
            request.first_scheduled_time = now
        request.status = Status.RUNNING
        self.running.append(request)
        return num_new

    def _reusable_prefix(self, request: Request) -> tuple[list[int], int]:
        """For a request with nothing computed: the prefix-cache blocks it starts from, and
        the transferred tokens beyond them. Transferred KV covers what the local cache does
        not, but never the last token: it is computed here to sample from (as vLLM's
        connector leaves it)."""
        if request.num_computed_tokens != 0:
            return [], 0
        kv = self.kv
        hit = kv.find_cached_prefix(request.block_hashes, request.num_tokens)
        external = 0
        if request.num_external_tokens > 0:
            reach = min(request.num_external_tokens, request.num_tokens - 1)
            external = max(0, reach - len(hit) * kv.block_size)
        return hit, external

    def _count_prefix_lookup(self, request: Request, num_cached: int, external: int) -> None:
        """vLLM counts a request's lookup once; re-lookups after preemption are kept apart
        (preempted_* stats) and not exported."""
        if request.num_cached_tokens >= 0:
            return
        request.num_cached_tokens = num_cached + external
        counters = self.counters
        counters.prefix_cache_queries += request.num_tokens
        counters.prefix_cache_hits += num_cached
        if request.num_external_tokens > 0:
            counters.external_prefix_cache_queries += request.num_tokens - num_cached
            counters.external_prefix_cache_hits += external

    def _add_to_plan(self, plan: StepPlan, request: Request, num_new: int) -> None:
        plan.scheduled.append((request, num_new))
        if request.num_computed_tokens + num_new >= request.num_tokens and num_new == 1:
            plan.num_decode_seqs += 1
            plan.decode_context_tokens += request.num_computed_tokens + 1
        else:
            plan.num_prefill_tokens += num_new
            plan.prefill_attention_pairs += num_new * (request.num_computed_tokens + num_new)

    def _preempt(self, request: Request) -> None:
        self.kv.free_blocks(request.block_ids)
        request.num_computed_tokens = 0
        request.num_registered_blocks = 0
        request.status = Status.PREEMPTED
        request.num_preemptions += 1
        self.counters.preemptions += 1
        self.waiting.appendleft(request)

    def update(self, plan: StepPlan, now: float = 0.0) -> StepResult:
        """Apply a computed step: advance, cache full blocks, sample, finish."""
        result = StepResult()
        kv = self.kv
        bs = kv.block_size
        counters = self.counters
        counters.steps += 1
        for request, num_new in plan.scheduled:
            if request.status is not Status.RUNNING:
                continue  # aborted while the step ran
            request.num_computed_tokens += num_new
            request.num_registered_blocks = kv.cache_full_blocks(
                request.block_ids,
                request.block_hashes,
                request.num_registered_blocks,
                request.num_computed_tokens // bs,
                request.all_token_ids,
                request.lora,
            )
            if request.num_computed_tokens < request.num_tokens:
                continue  # a prefill chunk; nothing sampled yet
            n_out = len(request.output_token_ids)
            if n_out == 0:
                counters.prompt_tokens += request.num_prompt_tokens
                request.first_token_time = now
                result.first_tokens.append(request)
            request.output_token_ids.append(request.planned_output_ids[n_out])
            request.num_tokens += 1
            request.last_token_time = now
            counters.generation_tokens += 1
            result.sampled.append(request)
            self._extend_hashes(request)
            n_out += 1
            if n_out >= len(request.planned_output_ids) and n_out < request.max_tokens:
                reason: str | None = "stop"
            elif n_out >= request.max_tokens or request.num_tokens >= self.config.max_model_len:
                reason = "length"
            else:
                reason = None
            if reason is not None:
                self.running.remove(request)
                self._finish(request, reason, now)
                result.finished.append(request)
        return result

    def _extend_hashes(self, request: Request) -> None:
        # Only when a new block just filled up; avoids rebuilding the token list every token.
        if request.num_tokens // self.kv.block_size > len(request.block_hashes):
            self._hash(request, request.all_token_ids())

    def _hash(self, request: Request, token_ids: Sequence[int]) -> None:
        """Extend the request's block hashes over ``token_ids``."""
        if self.vllm_root is None:
            extend_block_hashes(
                request.block_hashes,
                token_ids,
                self.kv.block_size,
                self.root_hash,
                _extra(request),
            )
            return
        lora = request.lora
        extend_chain(
            request.hash_chain,
            request.block_hashes,
            token_ids,
            self.kv.block_size,
            self.vllm_root,
            cache_salt=request.cache_salt,
            lora=(lora, self.lora_paths.get(lora, "")) if lora else None,
        )

    def release_held(self, request_id: str) -> int | None:
        """Free a held prefill's blocks (read by the decode engine, or expired); the prompt
        tokens they held, None when nothing is held under that id."""
        held = self.held.pop(request_id, None)
        if held is None:
            return None
        block_ids, tokens = held
        self.kv.free_blocks(block_ids)
        return tokens

    def _finish(self, request: Request, reason: str, now: float) -> None:
        if request.hold_on_finish and reason == "length" and request.block_ids:
            # vLLM's connector delays the free of a length-capped prefill leg only.
            self.held[request.request_id] = (list(request.block_ids), request.num_prompt_tokens)
            request.block_ids.clear()
        else:
            self.kv.free_blocks(request.block_ids)
        request.status = Status.FINISHED
        request.finish_reason = reason
        request.finished_time = now
        del self.requests[request.request_id]


def _extra(request: Request) -> bytes:
    extra = request.lora.encode() if request.lora else b""
    if request.cache_salt:
        extra += b"\0salt:" + request.cache_salt.encode()
    return extra
