"""Disaggregated prefill/decode, as vLLM's NixlConnector does it (``docs/engine-simulator.md``).

The wire protocol is vLLM's ``kv_transfer_params`` request/response field, unchanged, so a
router that drives the simulator drives a real vLLM with a KV connector the same way:

* prefill leg: a request with ``{"do_remote_decode": true, ...}`` (``max_tokens`` 1). The
  engine prefills, keeps the request's KV blocks (vLLM's delayed free, released when the decode
  engine has read them or after ``hold_s``) and answers with ``kv_transfer_params``
  ``{"do_remote_prefill": true, "remote_engine_id", "remote_block_ids", "remote_host",
  "remote_port", ...}``.
* decode leg: the client's request plus those params. The engine "reads" the blocks from the
  prefill engine over its side channel (here the prefill engine's own HTTP port,
  ``POST /kv_transfer/read``), waits the transfer time for their size instead of computing
  them, and decodes. A failed read is recomputed locally (vLLM's ``recompute`` policy).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import httpx

KVRole = Literal["kv_producer", "kv_consumer", "kv_both"]
KV_ROLES: tuple[KVRole, ...] = ("kv_producer", "kv_consumer", "kv_both")
#: The simulator's side channel, served on the prefill engine's HTTP port.
READ_PATH = "/kv_transfer/read"


class KVTransferError(Exception):
    """The decode engine could not read the remote blocks (the prefill engine is gone, or the
    blocks were released); the prompt is then computed locally."""


@dataclass(frozen=True, slots=True)
class KVTransferConfig:
    #: ``None``: no KV connector, ``kv_transfer_params`` ignored (plain ``vllm serve``).
    role: KVRole | None = "kv_both"
    #: Blocks of a finished prefill wait this long for their reader (vLLM's
    #: ``VLLM_NIXL_ABORT_REQUEST_TIMEOUT``, 480 s by default).
    hold_s: float = 480.0
    #: Effective bytes/s of the KV link (RDMA at 200 Gb/s, about 25 GB/s) ...
    bandwidth_bytes_per_s: float = 25e9
    #: ... plus a fixed cost per transfer (handshake, descriptor setup, notification).
    latency_s: float = 0.002
    #: Timeout of one read over the side channel.
    read_timeout_s: float = 2.0

    @property
    def producer(self) -> bool:
        return self.role in ("kv_producer", "kv_both")

    @property
    def consumer(self) -> bool:
        return self.role in ("kv_consumer", "kv_both")

    def transfer_time(self, num_tokens: int, bytes_per_token: float) -> float:
        """Seconds to move ``num_tokens`` tokens of KV cache (0 when there is nothing)."""
        if num_tokens <= 0:
            return 0.0
        return self.latency_s + num_tokens * bytes_per_token / self.bandwidth_bytes_per_s


def request_params(body: dict[str, Any]) -> dict[str, Any] | None:
    """The request's ``kv_transfer_params`` (None when absent); a non-object is refused."""
    value = body.get("kv_transfer_params")
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError("kv_transfer_params must be an object")
    return value


def producer_params(
    engine_id: str,
    request_id: str,
    block_ids: list[int],
    host: str,
    port: int,
    tp_size: int,
) -> dict[str, Any]:
    """What the prefill engine returns, with NixlConnector's keys."""
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": block_ids,
        "remote_engine_id": engine_id,
        "remote_request_id": request_id,
        "remote_host": host,
        "remote_port": port,
        "tp_size": tp_size,
    }


async def read_remote(client: httpx.AsyncClient, params: dict[str, Any], timeout_s: float) -> int:
    """Read (and release) the prefill engine's blocks; the prompt tokens they hold."""
    host, port = params.get("remote_host"), params.get("remote_port")
    if not isinstance(host, str) or not isinstance(port, int) or isinstance(port, bool):
        raise KVTransferError("kv_transfer_params lack remote_host/remote_port")
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    try:
        resp = await client.post(
            f"http://{host}:{port}{READ_PATH}",
            json={
                "remote_engine_id": params.get("remote_engine_id"),
                "remote_request_id": params.get("remote_request_id"),
                "remote_block_ids": params.get("remote_block_ids"),
            },
            timeout=timeout_s,
        )
    except httpx.HTTPError as exc:
        raise KVTransferError(f"side channel {host}:{port}: {exc!r}") from exc
    if resp.status_code != 200:
        raise KVTransferError(f"side channel {host}:{port}: status {resp.status_code}")
    try:
        tokens = resp.json()["num_tokens"]
    except (ValueError, KeyError, TypeError) as exc:
        raise KVTransferError(f"side channel {host}:{port}: bad answer") from exc
    if not isinstance(tokens, int) or tokens < 0:
        raise KVTransferError(f"side channel {host}:{port}: bad token count")
    return tokens
