"""Running cache calls on the cache's own event loop, whichever loop the ASGI server uses."""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any, TypeVar

from ._http import HTTPError

if TYPE_CHECKING:
    from .._cache import HiCache

__all__ = ["CacheLoop"]

T = TypeVar("T")


class CacheLoop:
    """Calls into a `HiCache` from any thread: directly on its loop, handed over otherwise.

    The cache raises `WrongThreadError` when touched from another loop, so an ASGI server
    running in its own thread (a separate uvicorn, a framework's worker loop) must pass each
    call to the cache's loop and wait for the answer without blocking its own loop.
    """

    __slots__ = ("_cache",)

    def __init__(self, cache: HiCache) -> None:
        self._cache = cache

    def _target(self) -> asyncio.AbstractEventLoop:
        # The owner loop is bound when the cache is entered; HiCache has no public accessor.
        loop = self._cache.loop
        if loop is None:
            raise HTTPError(
                503, "cache_unavailable", "the cache is not open (enter it with `async with`)"
            )
        if loop.is_closed() or not loop.is_running():
            raise HTTPError(503, "cache_unavailable", "the cache's event loop is not running")
        state = self.closed_state()
        if state is not None:
            # Its loop may run on after the close (the host's own loop): nothing to inspect.
            raise HTTPError(503, "cache_unavailable", f"the cache is {state}")
        return loop

    def closed_state(self) -> str | None:
        """`"closing"` or `"closed"` once the cache's close began, None before."""
        state = self._cache.state
        return state if state in ("closing", "closed") else None

    async def call(self, function: Callable[[], T]) -> T:
        """`function()` on the cache's loop, for synchronous cache methods."""
        loop = self._target()
        if loop is asyncio.get_running_loop():
            return function()
        future: concurrent.futures.Future[T] = concurrent.futures.Future()

        def run() -> None:
            if not future.set_running_or_notify_cancel():
                return  # the waiting request was cancelled first
            try:
                future.set_result(function())
            except BaseException as exc:
                future.set_exception(exc)

        try:
            loop.call_soon_threadsafe(run)
        except RuntimeError:  # closed between the check and the hand-off
            raise HTTPError(
                503, "cache_unavailable", "the cache's event loop is not running"
            ) from None
        return await asyncio.wrap_future(future)

    async def run(self, factory: Callable[[], Coroutine[Any, Any, T]]) -> T:
        """Await `factory()` on the cache's loop; cancelling the caller cancels it there."""
        loop = self._target()
        if loop is asyncio.get_running_loop():
            return await factory()
        coroutine = factory()
        try:
            future = asyncio.run_coroutine_threadsafe(coroutine, loop)
        except RuntimeError:
            coroutine.close()
            raise HTTPError(
                503, "cache_unavailable", "the cache's event loop is not running"
            ) from None
        return await asyncio.wrap_future(future)
