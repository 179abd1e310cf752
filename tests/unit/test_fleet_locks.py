"""The embedded mode's lock (SQLite has no advisory locks): one holder at a time, across
processes, released when its holder dies."""

from __future__ import annotations

import multiprocessing
from pathlib import Path
from typing import Any

from federation.fleet import locks


def _hold(ready: Any, release: Any, var_dir: str) -> None:
    from django.conf import settings

    settings.VAR_DIR = Path(var_dir)
    with locks._file_lock(7) as held:
        ready.put(held)
        release.get()


def test_the_file_lock_excludes_another_process_until_it_lets_go_or_dies(
    tmp_path: Path, settings: Any
) -> None:
    settings.VAR_DIR = tmp_path
    ctx = multiprocessing.get_context("fork")
    ready, release = ctx.Queue(), ctx.Queue()
    holder = ctx.Process(target=_hold, args=(ready, release, str(tmp_path)))
    holder.start()
    assert ready.get(timeout=10) is True
    with locks._file_lock(7) as held:
        assert held is False  # the other process holds it
    with locks._file_lock(8) as held:
        assert held is True  # another deployment's lock is free
    holder.kill()  # dies holding it: the kernel lets go
    holder.join(10)
    with locks._file_lock(7) as held:
        assert held is True
