"""Steps that must reach their end even when the task awaiting them is cancelled.

`anyio.CancelScope(shield=True)` stops anyio's own cancel scopes, not a plain
`task.cancel()` (what asyncio's timeouts and `asyncio.wait_for` use): that still lands inside
the shielded block. A step that must finish runs as a task of its own instead; the caller
waits for it through any cancellation and re-raises the cancellation afterwards.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

import anyio
import structlog

__all__ = ["run_uncancelled"]

_log = structlog.get_logger("hicache_async")


async def run_uncancelled(
    coro: Coroutine[Any, Any, None], *, on_cancel: Callable[[], None] | None = None
) -> bool:
    """Run `coro` to its end whatever cancels the caller meanwhile; True if the caller was
    cancelled (and should re-raise once this returns). What `coro` raises is raised here,
    unless the caller was cancelled: then it is logged, so the cancellation is not lost.

    `on_cancel`, if given, is called at each cancellation of the caller: a way to tell the
    step to hurry (a close that stops flushing) rather than to stop half-way. anyio cancel
    scopes around the caller are shielded so they do not re-deliver their cancellation on
    every wait.
    """
    task = asyncio.ensure_future(coro)
    cancelled = False
    with anyio.CancelScope(shield=True):
        while not task.done():
            try:
                await asyncio.shield(task)
            except asyncio.CancelledError:
                if task.cancelled():
                    raise  # the task itself was cancelled (the loop is shutting down)
                # The caller's cancellation, possibly landing just after the task finished:
                # its result is there either way.
                cancelled = True
                if on_cancel is not None and not task.done():
                    on_cancel()
            except Exception:  # the task failed: handled below, once it is done
                continue
    if cancelled and task.exception() is not None:
        # The caller re-raises its cancellation, which must not be lost to this error.
        _log.warning("hicache.uncancelled.failed", error=repr(task.exception()))
        return True
    task.result()  # its exception, if any, is the caller's
    return cancelled
