"""Table sync, pure parts and one long-poll against an in-memory transport (no sockets)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from regions.edge.sync import (
    SyncConfig,
    TableSync,
    accept_table,
    backoff_delay,
    load_persisted,
    persist_table,
)
from regions.edge.table import RoutingTable, TableError
from regions.tables.signing import SignatureError, sign

KEYS = {"k1": "secret-1"}


def doc(version: int, region: str = "eu-west", **kw: Any) -> dict[str, Any]:
    d: dict[str, Any] = {
        "schema_version": 1,
        "version": version,
        "region": region,
        "generated_at": "2026-11-29T09:00:00Z",
        "instances": [{"id": "i-1", "url": "http://127.0.0.1:9", "model": "llama"}],
    }
    d.update(kw)
    return d


def signed(version: int, region: str = "eu-west", key: str = "secret-1") -> bytes:
    return orjson.dumps(sign(doc(version, region), key, "k1"))


def test_backoff_is_bounded_full_jitter() -> None:
    assert backoff_delay(0, 0.5, 30.0, lambda: 1.0) == 0.5
    assert backoff_delay(3, 0.5, 30.0, lambda: 1.0) == 4.0
    assert backoff_delay(50, 0.5, 30.0, lambda: 1.0) == 30.0
    assert backoff_delay(5, 0.5, 30.0, lambda: 0.0) == 0.0


def test_accept_refuses_tampered_foreign_and_backwards_tables() -> None:
    t = accept_table(signed(3), KEYS, None, region="eu-west")
    assert t.version == 3
    tampered = orjson.loads(signed(4))
    tampered["instances"][0]["url"] = "http://evil.example"
    with pytest.raises(SignatureError, match="tampered"):
        accept_table(orjson.dumps(tampered), KEYS, t, region="eu-west")
    with pytest.raises(SignatureError, match="unknown key"):
        accept_table(orjson.dumps(sign(doc(4), "x", "k9")), KEYS, t, region="eu-west")
    with pytest.raises(TableError, match="for region 'us-east'"):
        accept_table(signed(4, "us-east"), KEYS, t, region="eu-west")
    with pytest.raises(TableError, match="does not advance"):
        accept_table(signed(3), KEYS, t, region="eu-west")
    with pytest.raises(SignatureError, match="unsigned"):
        accept_table(orjson.dumps(doc(5)), KEYS, t, region="eu-west")


def test_persist_is_atomic_and_reloaded_only_when_still_valid(tmp_path: Path) -> None:
    path = tmp_path / "state" / "routing-table.json"
    assert load_persisted(path, KEYS, region="eu-west") is None
    persist_table(path, signed(7))
    assert [p.name for p in path.parent.iterdir()] == ["routing-table.json"]
    loaded = load_persisted(path, KEYS, region="eu-west")
    assert loaded is not None and loaded.version == 7
    assert load_persisted(path, {"k1": "rotated"}, region="eu-west") is None
    assert load_persisted(path, KEYS, region="us-east") is None
    path.write_bytes(b"{not json")
    assert load_persisted(path, KEYS, region="eu-west") is None


class Target:
    def __init__(self, table: RoutingTable) -> None:
        self.table = table
        self.rejected: list[str] = []

    def install_table(self, table: RoutingTable) -> None:
        self.table = table

    def table_rejected(self, reason: str) -> None:
        self.rejected.append(reason)

    def heartbeat_document(self) -> dict[str, Any]:
        return {"applied_table_version": self.table.version, "instances": []}


def make_sync(tmp_path: Path, start: int = 1) -> tuple[TableSync, Target]:
    cfg = SyncConfig(
        control_plane="http://cp.test",
        credential="fe_cred",
        keys=KEYS,
        state_dir=tmp_path,
        edge_name="edge-eu-1",
    )
    target = Target(accept_table(signed(start), KEYS, None, region="eu-west"))
    return TableSync(cfg, "eu-west", target, rand=lambda: 1.0), target


def test_fetch_once_applies_persists_and_refuses(tmp_path: Path) -> None:
    sync, target = make_sync(tmp_path)
    answers: list[httpx.Response] = [
        httpx.Response(200, content=signed(2)),
        httpx.Response(304),
        httpx.Response(200, content=signed(2, "us-east")),
        httpx.Response(503, headers={"Retry-After": "2"}),
        httpx.Response(401, text="bad credential"),
    ]
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return answers.pop(0)

    async def run() -> list[float]:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            return [await sync.fetch_once(client, 25) for _ in range(5)]

    pauses = asyncio.run(run())
    assert pauses[:2] == [0.0, 0.0]
    assert target.table.version == 2
    assert seen[0].headers["if-none-match"] == '"1"' and seen[1].headers["if-none-match"] == '"2"'
    assert seen[0].headers["authorization"] == "Bearer fe_cred"
    assert seen[0].url.path == "/api/v1/edges/eu-west/routing-table"
    assert seen[0].url.params["wait"] == "25"
    persisted = load_persisted(tmp_path / "routing-table.json", KEYS, region="eu-west")
    assert persisted is not None and persisted.version == 2
    # Refused table: old one kept, backoff grows; 503 honours Retry-After; 401 backs off more.
    assert pauses[2] == 0.5 and target.rejected and target.table.version == 2
    assert pauses[3] == 2.0
    assert pauses[4] == 1.0 and "401" in sync.last_error


def test_unreachable_control_plane_backs_off(tmp_path: Path) -> None:
    sync, target = make_sync(tmp_path)

    def handler(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    async def run() -> list[float]:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            return [await sync.fetch_once(client, 25) for _ in range(3)]

    assert asyncio.run(run()) == [0.5, 1.0, 2.0]
    assert target.table.version == 1 and "unreachable" in sync.last_error
