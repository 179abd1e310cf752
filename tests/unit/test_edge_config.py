"""The edge's settings: every CLI default is the config's own, and P/D is configurable."""

from __future__ import annotations

from pathlib import Path

import pytest

from regions.edge.cli import build_parser, config_from_args
from regions.edge.config import DisaggConfig, EdgeConfig


def test_without_flags_the_cli_builds_the_default_config(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("FEDINFER_HOP_KEYS", raising=False)
    table = tmp_path / "t.json"
    cfg = config_from_args(build_parser().parse_args(["--region", "eu", "--table", str(table)]))
    assert cfg == EdgeConfig(region="eu", table_path=table)


def test_disagg_flags_reach_the_config(tmp_path: Path) -> None:
    opts = build_parser().parse_args(
        [
            "--region", "eu", "--table", str(tmp_path / "t.json"),
            "--disagg-min-prompt-tokens", "64", "--disagg-kv-full", "0.9",
            "--disagg-wait-poll", "0.05",
        ]
    )  # fmt: skip
    assert config_from_args(opts).disagg == DisaggConfig(
        min_prompt_tokens=64, kv_full=0.9, wait_poll_s=0.05
    )
