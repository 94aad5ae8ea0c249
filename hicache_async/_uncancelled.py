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

__all__ = ["finish_uncancelled", "run_uncancelled"]

_log = structlog.get_logger("hicache_async")


async def run_uncancelled(
    coro: Coroutine[Any, Any, object], *, on_cancel: Callable[[], object] | None = None
) -> bool:
    """Run `coro` to its end whatever cancels the caller meanwhile; True if the caller was
    cancelled (and should re-raise once this returns). What `coro` raises is raised here,
    unless the caller was cancelled: then it is logged, so the cancellation is not lost.

    `on_cancel`, if given, is called at each cancellation of the caller: a way to tell the
    step to hurry (a close that stops flushing) rather than to stop half-way. anyio cancel
    scopes around the caller are shielded throughout: their cancellation reaches the caller
    at its next checkpoint after this returns (`finish_uncancelled` hears them at once).
    """
    return await _finish(coro, on_cancel, hear_scopes=False) is not None


async def finish_uncancelled(
    coro: Coroutine[Any, Any, object], *, on_cancel: Callable[[], object] | None = None
) -> asyncio.CancelledError | None:
    """`run_uncancelled`, hearing anyio cancel scopes too: the first cancellation of the
    caller, a scope's deadline or a cancelled task group included, calls `on_cancel` at once
    and is returned, for the caller to raise (`raise cancelled`) once it is done. Raise that
    very exception: anyio lets a scope swallow only its own cancellation, and a fresh
    `CancelledError` would escape the scope and cancel whatever runs the caller.
    """
    return await _finish(coro, on_cancel, hear_scopes=True)


async def _finish(
    coro: Coroutine[Any, Any, object],
    on_cancel: Callable[[], object] | None,
    *,
    hear_scopes: bool,
) -> asyncio.CancelledError | None:
    task = asyncio.ensure_future(coro)
    caught: asyncio.CancelledError | None = None

    def cancelled(exc: asyncio.CancelledError) -> None:
        nonlocal caught
        if task.cancelled():
            raise exc  # the task itself was cancelled (the loop is shutting down)
        # The caller's cancellation, possibly landing just after the task finished: its
        # result is there either way.
        if caught is None:
            caught = exc
        if on_cancel is not None and not task.done():
            on_cancel()

    if hear_scopes:
        # One wait open to anyio's scopes, so their cancellation is heard and hurries the
        # step; the rest is shielded, since a scope re-delivers its cancellation on every
        # wait until the caller leaves it.
        try:
            await asyncio.wait([task])  # cancelling this wait leaves the task alone
        except asyncio.CancelledError as exc:
            cancelled(exc)
    with anyio.CancelScope(shield=True):
        while not task.done():
            try:
                await asyncio.wait([task])
            except asyncio.CancelledError as exc:
                cancelled(exc)
    if caught is not None and task.exception() is not None:
        # The caller re-raises its cancellation, which must not be lost to this error.
        _log.warning("hicache.uncancelled.failed", error=repr(task.exception()))
        return caught
    task.result()  # its exception, if any, is the caller's
    return caught
