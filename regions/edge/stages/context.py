"""What one request carries through the edge's stages, and what the stages read of the edge.

A completion request passes through named stages, each a module with a public interface:

1. **admit** (``admit.py``, the tenant rules in ``admission.py``): read and check the request,
   authenticate and charge its tenant, decide whether it may be served here or must go to
   another region first;
2. **place** (``place.py``): candidates from the current table, health and load, and the
   scheduler's decision (``scheduler.py``);
3. **queue** (``gateway_line.py``): wait at the gateway while the chosen instance has no slot;
4. **forward** (``forward.py``): try instances over pooled connections, retry elsewhere while
   nothing reached the client; two hops for P/D (``disagg.py``), another region's edge for a
   spill-over (``spill_over.py``);
5. **relay** (``relay.py``): pass the answer through byte for byte, streams included;
6. **record** (``record.py``): metrics of the answer, and the tenant's settlement at the end.

``app.py`` runs them in that order with one :class:`RequestContext` and keeps the table state.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Container, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from regions.edge.http.endpoints import Endpoint
from regions.edge.http.parse import ParsedRequest, UsageTap
from regions.edge.http.server import Receive, Scope, Send
from regions.edge.http.upstream import Response, UpstreamPool
from regions.edge.observability import CacheView
from regions.edge.policy.admission import TenantState
from regions.edge.policy.budget import Hold
from regions.edge.policy.spill import Remote, Spill
from regions.edge.policy.split import Split
from regions.edge.view.token_prefix import PromptTokens
from regions.tables.schema import Instance, RoutingTable

if TYPE_CHECKING:  # imported only when tracing is on (opentelemetry is an optional extra)
    from regions.edge.tracing import RequestTrace


@dataclass(slots=True)
class RequestContext:
    """One admitted request, from admission to its record: one object, mutated by the stages.

    ``complete`` is set just before the last body message: the server reports a disconnect once
    the response is complete, which must not cancel the request's bookkeeping.
    """

    req: ParsedRequest
    send: Send
    #: The ``traceparent`` every upstream hop gets (and the client, in the answer).
    traceparent: str
    #: ``time.perf_counter()`` at arrival: TTFT and end-to-end times are measured from it.
    arrived: float
    tenant: TenantState | None = None
    #: Tokens charged against the tenant's rate at admission (0: not charged here).
    charged: int = 0
    #: The request's session (:func:`regions.edge.policy.sessions.session_key`), if it names one.
    session_key: int | None = None
    #: The tenant's salt for :class:`~regions.edge.policy.prefix_index.SeenPrefixes` (None: no
    #: tenants, show everything).
    salt: int | None = None
    #: Where it may go in other regions (None: only here).
    spill: Spill | None = None
    #: The prompt's block hashes (``placement.Placement.hash_prompt``).
    hashes: Sequence[int] = ()
    #: Its token ids, when the model's tokenizer renders it exactly (``token_prefix.py``).
    tokens: PromptTokens | None = None
    #: What the route header may show this tenant of the prefix cache.
    view: CacheView | None = None
    #: Seconds waited at the gateway, over every placement.
    queue_s: float = 0.0
    #: Instances tried before the current one.
    retries: int = 0
    #: Why the last try failed (``instance: reason``), for the refusal's log line.
    last_failure: str = ""
    #: A caller with more than one hop (P/D) sets the route header and adds Server-Timing.
    route: bytes | None = None
    timing_extra: bytes = b""
    #: The response has started (no retry elsewhere any more).
    sent: bool = False
    complete: bool = False
    disconnected: bool = False
    #: Prompt + completion tokens the engine reported (None: unknown, e.g. a cut stream).
    used_tokens: int | None = None
    #: For the usage record (``metering/meter.py``): the region whose edge the client called (None:
    #: this one), the key's public prefix, the instance that accepted the request (the last
    #: one tried), the answer's status (a refusal's too: 0 until answered) and TTFT, and the
    #: prompt tokens the engine reported.
    entry_region: str | None = None
    key_prefix: str | None = None
    served_by: Instance | None = None
    status: int = 0
    ttft_s: float | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    #: The stream's tap, while the answer is a stream: what a cut stream relayed.
    tap: UsageTap | None = None
    #: Its worst-case price held on the tenant's budget here (``budget.py``; None: none).
    hold: Hold | None = None
    #: Its spans (``tracing.py``); None when tracing is off: each stage checks this once.
    trace: RequestTrace | None = None
    #: The events relayed so far, kept while the stream may be continued on another engine
    #: (``continuation.py``); None: it may not (or outgrew ``continue_memory_bytes``).
    memory: list[bytes] | None = None
    #: Bytes more it may keep.
    memory_room: int = 0
    #: Why the stream may not be continued (``not_continuable``, ``too_long``, P/D's), if so.
    uncontinuable: str | None = None
    #: The upstream answer being relayed (a drain migrates a stream by abandoning it) and
    #: when it started there (``time.monotonic()``); why it was abandoned, if it was.
    upstream: Response | None = None
    upstream_since: float = 0.0
    abandoned: str | None = None
    #: For the usage record of a continued stream: ``region/instance`` of every leg, why the
    #: first continuation happened, the prompt tokens engines processed again, and the output
    #: tokens the client had received before the current leg.
    legs: list[str] | None = None
    #: It continues a stream another edge relays and meters (``hop.CONTINUATION_HEADER``):
    #: no usage record here.
    metered_elsewhere: bool = False
    continue_reason: str | None = None
    reprefill_tokens: int = 0
    relayed_before: int = 0


#: The admit stage: ``await admit(scope, receive, send, endpoint)``, the admitted request or
#: None (refused and answered, or the client left).
AdmitStage = Callable[[Scope, Receive, Send, Endpoint], Awaitable[RequestContext | None]]


class Fleet(Protocol):
    """What the stages read of the edge's current table and its connections (``app.Edge``).

    Each is replaced whole when a table is applied, never changed in place.
    """

    @property
    def table(self) -> RoutingTable: ...
    @property
    def by_model(self) -> Mapping[str, tuple[Instance, ...]]: ...
    @property
    def instances(self) -> Mapping[str, Instance]: ...
    @property
    def prefill_rates(self) -> Mapping[str, float]: ...
    @property
    def spill(self) -> Mapping[str, tuple[Remote, ...]]: ...
    @property
    def splits(self) -> Mapping[str, Split]: ...
    @property
    def cold_models(self) -> Container[str]:
        """Served names (models and adapters) scaled to zero here: held, not refused."""
        ...

    @property
    def several_edges(self) -> bool: ...
    @property
    def ramping(self) -> bool: ...
    @property
    def upstream(self) -> UpstreamPool: ...
