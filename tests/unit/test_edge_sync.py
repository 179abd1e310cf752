"""Table sync, pure parts and the control plane's answers from an in-memory transport (no
sockets)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from regions.edge.cli import build_parser, sync_from_args
from regions.edge.control.table_sync import (
    SyncConfig,
    TableSync,
    accept_table,
    backoff_delay,
    initial_table,
    load_persisted,
    persist_table,
)
from regions.tables.schema import RoutingTable, TableError
from regions.tables.signing import SignatureError, sign

KEYS = {"k1": "secret-1"}


def doc(version: int, region: str = "eu-west", **kw: Any) -> dict[str, Any]:
    d: dict[str, Any] = {
        "schema_version": 1,
        "version": version,
        "region": region,
        "generated_at": "2026-11-29T09:00:00Z",
        "instances": [{"id": "i-1", "url": "http://127.0.0.1:9", "model": "llama"}],
        "tenants": [],
    }
    d.update(kw)
    return d


def signed(version: int, region: str = "eu-west", key: str = "secret-1", **kw: Any) -> bytes:
    return orjson.dumps(sign(doc(version, region, **kw), key, "k1"))


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


def test_a_table_without_tenants_is_refused_in_control_plane_mode(tmp_path: Path) -> None:
    # tenants: null turns admission off (any key accepted): only file mode may do that.
    with pytest.raises(TableError, match="no tenant list"):
        accept_table(signed(3, tenants=None), KEYS, None, region="eu-west")
    # Running: refused and counted, the last good table keeps serving.
    sync, target = make_sync(tmp_path)
    assert not sync.offer(signed(2, tenants=None))
    assert target.table.version == 1 and "no tenant list" in target.rejected[0]
    # Persisted: not started from.
    path = tmp_path / "routing-table.json"
    persist_table(path, signed(4, tenants=None))
    assert load_persisted(path, KEYS, region="eu-west") is None


def start_cfg(tmp_path: Path) -> SyncConfig:
    return SyncConfig(
        control_plane="http://cp.test",
        credential="fe_cred",
        keys=KEYS,
        state_dir=tmp_path,
        initial_timeout_s=0.0,
    )


_CLIENT = httpx.Client


def control_plane(
    monkeypatch: pytest.MonkeyPatch, answer: Callable[[httpx.Request], httpx.Response]
) -> None:
    """``initial_table``'s client talks to ``answer`` instead of the network."""
    monkeypatch.setattr(
        httpx, "Client", lambda **kw: _CLIENT(transport=httpx.MockTransport(answer), **kw)
    )


def test_first_start_refuses_a_control_plane_table_older_than_the_persisted_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = start_cfg(tmp_path)
    persist_table(cfg.persisted_path, signed(5))
    control_plane(monkeypatch, lambda request: httpx.Response(200, content=signed(3)))
    with caplog.at_level(logging.WARNING, "fedinfer.edge.sync"):
        assert initial_table(cfg, "eu-west").version == 5
    assert "version 3 is older than the persisted 5 (a rollback" in caplog.text
    assert "starting from the persisted table version 5" in caplog.text
    persisted = load_persisted(cfg.persisted_path, KEYS, region="eu-west")
    assert persisted is not None and persisted.version == 5
    # The same version is no news (as a 304); a newer one wins and is persisted.
    control_plane(monkeypatch, lambda request: httpx.Response(200, content=signed(5)))
    assert initial_table(cfg, "eu-west").version == 5
    control_plane(monkeypatch, lambda request: httpx.Response(200, content=signed(6)))
    assert initial_table(cfg, "eu-west").version == 6
    persisted = load_persisted(cfg.persisted_path, KEYS, region="eu-west")
    assert persisted is not None and persisted.version == 6


def test_first_start_refuses_a_table_without_tenants(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = start_cfg(tmp_path)
    control_plane(monkeypatch, lambda request: httpx.Response(200, content=signed(7, tenants=None)))
    # No good table at all: the edge does not start, and says why.
    with pytest.raises(TableError, match=r"no tenant list.*none persisted"):
        initial_table(cfg, "eu-west")
    assert not cfg.persisted_path.exists()
    # With a good persisted table, that one serves.
    persist_table(cfg.persisted_path, signed(5))
    assert initial_table(cfg, "eu-west").version == 5


def test_the_table_key_ring_comes_from_a_file_or_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cred = tmp_path / "cred"
    cred.write_text("fe_cred\n")
    ring = tmp_path / "table-keys"
    ring.write_text("k1=secret-1\nk0=old\n")
    args = ["--region", "eu-west", "--control-plane", "http://cp.test"]
    args += ["--credential-file", str(cred)]
    monkeypatch.delenv("FEDINFER_TABLE_KEYS", raising=False)
    with pytest.raises(ValueError, match="needs --table-keys-file"):
        sync_from_args(build_parser().parse_args(args))
    cfg = sync_from_args(build_parser().parse_args([*args, "--table-keys-file", str(ring)]))
    assert cfg is not None and dict(cfg.keys) == {"k1": "secret-1", "k0": "old"}
    monkeypatch.setenv("FEDINFER_TABLE_KEYS", "k1=from-env")
    cfg = sync_from_args(build_parser().parse_args(args))
    assert cfg is not None and dict(cfg.keys) == {"k1": "from-env"}
    with pytest.raises(ValueError, match="needs --control-plane"):
        sync_from_args(
            build_parser().parse_args(
                ["--region", "r", "--table", "t.json", "--table-keys-file", str(ring)]
            )
        )
