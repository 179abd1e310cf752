"""The admit stage: from an HTTP request to an admitted :class:`RequestContext`, or a refusal.

Before the body, the tenant's API key (``admission.py`` holds the tenant rules); then the body,
bounded and JSON; what routing needs of it (``parse.py``); the session id; the tenant's model
policy and cache salt; whether it may be served here or must go to another region first
(residency, a model not served here, this region's ramp while it comes back: the spill-over
stage decides, ``spill_over.py``);
last, the worst case of its price held on the tenant's budget (``budget.py``) when it is to be
served here, and the charge against the tenant's rate, unless a fellow edge already charged it.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from regions.edge.config import EdgeConfig
from regions.edge.http.endpoints import Endpoint
from regions.edge.http.errors import EdgeError
from regions.edge.http.parse import parse_request, with_cache_salt
from regions.edge.http.server import Receive, Scope, Send
from regions.edge.metering.meter import Meter
from regions.edge.observability import child_traceparent
from regions.edge.policy.admission import Admission, TenantState, public_prefix
from regions.edge.policy.budget import Budgets, Hold
from regions.edge.policy.hop import (
    CONTINUATION_HEADER,
    HOP_HEADER,
    HopVerifier,
    continuation_signed,
)
from regions.edge.policy.prefix_index import root_seed
from regions.edge.policy.sessions import MAX_SESSION_ID_BYTES, session_key
from regions.edge.stages.context import RequestContext
from regions.edge.stages.relay import JSON, Relay
from regions.edge.stages.spill_over import SpillOver

_Headers = tuple[bytes | None, bytes | None, str | None, bytes | None, bool]
_SPOOL_FULL = EdgeError(
    503,
    "This edge cannot record usage right now (its usage spool is full); retry shortly.",
    "usage_spool_full",
    retry_after=5,
)


class ClientGone(Exception):
    """The client disconnected while sending its request body."""


async def read_body(scope: Scope, receive: Receive, limit: int) -> bytes:
    """The request body: JSON, at most ``limit`` bytes (413 as soon as it is known to be more)."""
    ctype = b""
    for name, value in scope["headers"]:
        if name == b"content-type":
            ctype = value
        elif name == b"content-length" and value.isdigit() and int(value) > limit:
            raise EdgeError(413, f"request body exceeds {limit} bytes", "body_too_large")
    if not ctype.split(b";", 1)[0].strip().lower() == JSON:
        raise EdgeError(415, "Content-Type must be application/json", "unsupported_media_type")
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        chunk = message.get("body", b"")
        if chunk:
            size += len(chunk)
            if size > limit:
                raise EdgeError(413, f"request body exceeds {limit} bytes", "body_too_large")
            chunks.append(chunk)
        if not message.get("more_body", False):
            break
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def _request_headers(headers: Iterable[tuple[bytes, bytes]]) -> _Headers:
    """(authorization, x-session-id, traceparent, the hop signature, whether it continues
    another edge's stream) as the client sent them."""
    authorization = session_id = hop = None
    trace: str | None = None
    continuation = False
    for name, value in headers:
        if name == b"authorization":
            authorization = value
        elif name == b"x-session-id":
            session_id = value
        elif name == b"traceparent":
            trace = value.decode("latin-1")
        elif name == HOP_HEADER:
            hop = value
        elif name == CONTINUATION_HEADER:
            continuation = True
    return authorization, session_id, trace, hop, continuation


def _check_session(session: bytes | None, from_header: bool) -> None:
    if session is not None and len(session) > MAX_SESSION_ID_BYTES:
        raise EdgeError(
            400,
            f"session ids (x-session-id, or the body's 'user') may be at most "
            f"{MAX_SESSION_ID_BYTES} bytes",
            "invalid_session_id",
            None if from_header else "user",
        )


class Admit:
    """The admit stage of one edge; ``await admit(scope, receive, send, endpoint)``."""

    __slots__ = ("admission", "budgets", "cfg", "hops", "meter", "relay", "spill_over")

    def __init__(
        self,
        cfg: EdgeConfig,
        spill_over: SpillOver,
        admission: Admission,
        hops: HopVerifier,
        relay: Relay,
        meter: Meter | None,
        budgets: Budgets,
    ) -> None:
        self.cfg = cfg
        self.spill_over = spill_over
        self.admission = admission
        self.hops = hops
        self.relay = relay
        self.meter = meter
        self.budgets = budgets

    async def __call__(
        self, scope: Scope, receive: Receive, send: Send, endpoint: Endpoint
    ) -> RequestContext | None:
        """The admitted request; None when it was refused (and answered) or its client left."""
        arrived = time.perf_counter()
        authorization, session_id, trace, hop, continuation = _request_headers(scope["headers"])
        admission = self.admission
        tenant: TenantState | None = None
        hold: Hold | None = None
        key_prefix: str | None = None
        try:
            meter = self.meter  # a full spool under --usage-spool-full refuse: 503
            if meter is not None and meter.spool.full and meter.refuse_when_full:
                raise _SPOOL_FULL
            if admission.enabled:
                # Before the body: an unauthenticated client does not get 4 MB read for it.
                tenant = admission.authenticate(authorization, time.time())
            raw = await read_body(scope, receive, self.cfg.max_body_bytes)
            req = parse_request(raw, endpoint=endpoint, bytes_per_token=self.cfg.bytes_per_token)
            session = session_id if session_id is not None else _user_bytes(req.user)
            _check_session(session, session_id is not None)
            if tenant is not None:
                admission.policy(tenant, req.model)
            if endpoint.queued and (
                req.cache_salt is not None or (tenant is not None and tenant.policy.cache_salt)
            ):
                req = with_cache_salt(req, tenant.policy.cache_salt if tenant else None)
            # A request that already hopped is served here or refused: never forwarded again.
            point_key = session if session is not None else raw
            spill = self.spill_over.plan(
                req, tenant, point_key, hop is not None, authorization, session_id
            )
            # Charged where it entered: a hop signed by a fellow edge was charged there; a
            # continuation it signed is metered and held there too.
            origin = self._hop_origin(hop, raw, authorization, continuation)
            metered_there = origin if continuation else None
            charged = 0
            if tenant is not None:
                if self.meter is not None or tenant.policy.budget is not None:
                    key_prefix = public_prefix(authorization)
                # Held where it is served: a request that must go elsewhere is held there.
                if (
                    tenant.policy.budget is not None
                    and endpoint.metered
                    and not (spill and spill.targets)
                    and metered_there is None
                ):
                    hold = self.budgets.reserve(
                        tenant.slug,
                        key_prefix,
                        req.model,
                        req.prompt_tokens,
                        req.max_output_tokens,
                    )
                if origin is None:
                    admission.rate(tenant, req.cost_tokens, time.monotonic())
                    charged = req.cost_tokens
        except EdgeError as err:
            if hold is not None:
                self.budgets.release(hold)
            await self.relay.refuse(send, err)
            return None
        except ClientGone:
            return None
        return RequestContext(
            req=req,
            send=send,
            traceparent=child_traceparent(trace)[1],
            arrived=arrived,
            tenant=tenant,
            charged=charged,
            session_key=(
                session_key(tenant.slug if tenant is not None else "", req.model, session)
                if session is not None
                else None
            ),
            salt=root_seed(tenant.slug) if tenant is not None else None,
            spill=spill,
            entry_region=origin,
            key_prefix=key_prefix,
            hold=hold,
            metered_elsewhere=metered_there is not None,
        )

    def _hop_origin(
        self, hop: bytes | None, raw: bytes, authorization: bytes | None, continuation: bool
    ) -> str | None:
        """The region a fellow edge forwarded the request from (None: not a verified hop)."""
        if hop is None:
            return None
        return self.hops.verify(
            hop, continuation_signed(raw) if continuation else raw, authorization
        )


def _user_bytes(user: str | None) -> bytes | None:
    return user.encode() if user is not None else None
