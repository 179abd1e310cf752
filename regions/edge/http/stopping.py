"""What a stop that takes long is waiting for.

Once a stop has waited :data:`SLOW_STOP_S`, it logs where each task it still waits for is
suspended (:func:`await_chain`): the edge server's shutdown for requests still in flight, the
edge app's for background loops that did not end when cancelled. A task that outlives a stop is
a defect worth seeing. Both stops use this, and neither owns the other, so it has its own module.

Each step of a stop is also bounded (:func:`stop_step`): a process that never exits on SIGTERM
is killed by its supervisor (Kubernetes after the grace period) with nothing said; one that
names the step it abandoned and exits can be mended.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from typing import Any

#: After this long, a stop that still waits says what for (``await_chain``).
SLOW_STOP_S = 5.0


def await_chain(task: asyncio.Future[Any]) -> str:
    """Where a task is suspended: its coroutines from the outermost in, ``name:line`` each."""
    where: list[str] = []
    coro = task.get_coro() if isinstance(task, asyncio.Task) else None
    while coro is not None and len(where) < 32:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
        if frame is None:
            break
        where.append(f"{frame.f_code.co_name}:{frame.f_lineno}")
        coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
    name = task.get_name() if isinstance(task, asyncio.Task) else repr(task)
    return f"{name} at " + " > ".join(where)


async def stop_step(
    what: str, step: Awaitable[Any], log: logging.Logger, timeout_s: float = SLOW_STOP_S
) -> None:
    """Await one step of a stop for at most ``timeout_s``; a step still running then is logged
    with where it waits, cancelled and left (after at most another second), so the stop ends."""
    task = asyncio.ensure_future(step)
    done, _ = await asyncio.wait({task}, timeout=timeout_s)
    if done:
        task.result()  # a step that failed fails the stop, as before
        return
    log.error("stop: %s still running after %.0f s, abandoned: %s", what, timeout_s,
              await_chain(task))  # fmt: skip
    task.cancel()
    await asyncio.wait({task}, timeout=1.0)
