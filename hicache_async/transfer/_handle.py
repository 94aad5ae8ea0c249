"""`LayerwiseCopy`: the awaitable a copy engine returns, one readiness point per layer."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Generator
from typing import Any

from .._errors import WrongThreadError, index_of

__all__ = ["LayerwiseCopy"]


class LayerwiseCopy:
    """A copy of a batch of pages, every layer, whose layers complete in order.

    `await copy.layer(i)` returns once layer i has landed, so a model can start computing on
    layer 0 while later layers are still in flight; `await copy` waits for all of them.

    Waiting is never what drives the copy: cancelling a task that awaits a layer or the whole
    copy leaves the copy running to completion (its destination pages are being written), and
    done callbacks still run. Done callbacks registered before completion run synchronously as
    the copy completes, so by the time `done()` is true or any `await copy` returns, the
    bookkeeping they do (references released, pages placed) has happened.

    Only the engine that created it completes it; everything here runs on one loop's thread.
    """

    __slots__ = (
        "_callbacks",
        "_done",
        "_exception",
        "_landed",
        "_loop",
        "_nbytes",
        "_num_layers",
        "_num_pages",
        "_on_finish",
        "_waiters",
    )

    def __init__(
        self, loop: asyncio.AbstractEventLoop, num_layers: int, num_pages: int, nbytes: int = 0
    ) -> None:
        self._loop = loop
        self._num_layers = num_layers
        self._num_pages = num_pages
        self._nbytes = nbytes
        self._landed = 0
        self._done = False
        self._exception: BaseException | None = None
        self._waiters: list[tuple[int, asyncio.Future[None]]] = []
        self._callbacks: list[Callable[[LayerwiseCopy], object]] = []
        # The engine's bookkeeping, run synchronously at completion (before any callback).
        self._on_finish: Callable[[LayerwiseCopy], None] | None = None

    # -- the awaiting side ---------------------------------------------------------------------

    def _check_loop(self) -> None:
        # Futures and callbacks of another loop would fail inside asyncio, after this copy's
        # waiter list was already changed from the wrong thread.
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is not self._loop:
            raise WrongThreadError(
                "a LayerwiseCopy belongs to the event loop of the cache that made it; "
                "await it there (asyncio.run_coroutine_threadsafe from other threads)"
            )

    async def layer(self, i: int) -> None:
        """Return once layer `i` has landed; raise the copy's error if it failed before then.

        Raises `WrongThreadError` unless awaited on the copy's own event loop.
        """
        self._check_loop()
        i = index_of(i, "layer")
        if not 0 <= i < self._num_layers:
            raise ValueError(f"layer {i} is out of range [0, {self._num_layers})")
        if i < self._landed:
            return
        if self._exception is not None:
            raise self._exception
        # A private future per waiter: cancelling this waiter cancels only its own future.
        waiter: asyncio.Future[None] = self._loop.create_future()
        entry = (i, waiter)
        self._waiters.append(entry)
        try:
            await waiter
        finally:
            if entry in self._waiters:
                self._waiters.remove(entry)
        if i >= self._landed and self._exception is not None:
            raise self._exception

    async def _wait_all(self) -> None:
        await self.layer(self._num_layers - 1)

    def __await__(self) -> Generator[Any, None, None]:
        """Wait until every layer has landed (raising the copy's error if it failed)."""
        return self._wait_all().__await__()

    def done(self) -> bool:
        """Whether every layer has landed or the copy has failed."""
        return self._done

    def exception(self) -> BaseException | None:
        """The copy's error, or None if it succeeded or is still running."""
        return self._exception

    # Read-only: the engine copies `num_layers` layers, and the copy is done once they landed.
    @property
    def num_layers(self) -> int:
        """Layers the copy moves."""
        return self._num_layers

    @property
    def num_pages(self) -> int:
        """Pages the copy moves."""
        return self._num_pages

    @property
    def nbytes(self) -> int:
        """Bytes the copy moves."""
        return self._nbytes

    @property
    def layers_landed(self) -> int:
        """How many layers (a prefix: 0 .. n-1) have landed so far."""
        return self._landed

    def add_done_callback(self, fn: Callable[[LayerwiseCopy], object]) -> None:
        """Call `fn(self)` on the loop once the copy is done (succeeded or failed); what it
        returns is ignored.

        Registered before completion, `fn` runs synchronously as the copy completes, before
        `done()` can be observed true; an exception it raises goes to the loop's exception
        handler. If the copy is already done, `fn` is scheduled with `call_soon`. Raises
        `WrongThreadError` unless called on the copy's own event loop.
        """
        self._check_loop()
        if self._done:
            self._loop.call_soon(fn, self)
        else:
            self._callbacks.append(fn)

    # -- the engine's side (always on the loop thread) ----------------------------------------

    def _layer_landed(self, layer: int) -> None:
        if self._done or layer < self._landed:
            return
        self._landed = layer + 1
        if self._landed >= self._num_layers:
            self._finish()
            return
        self._wake(self._landed)

    def _fail(self, exc: BaseException) -> None:
        if self._done:
            return
        self._exception = exc
        self._finish()

    def _finish(self) -> None:
        self._done = True
        if self._on_finish is not None:
            self._on_finish(self)
        # Run now, not with `call_soon`: `done()` is already true and `layer()` returns without
        # yielding for a landed layer, so a deferred callback would leave a window where the
        # copy looks finished but its bookkeeping has not run. Each is guarded, so one failing
        # callback neither skips the others nor leaves a waiter hanging.
        callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            try:
                fn(self)
            except Exception as exc:
                self._loop.call_exception_handler(
                    {"message": "LayerwiseCopy done callback failed", "exception": exc}
                )
        self._wake(self._num_layers)

    def _wake(self, below: int) -> None:
        remaining: list[tuple[int, asyncio.Future[None]]] = []
        for entry in self._waiters:
            layer, waiter = entry
            if layer < below or self._done:
                if not waiter.done():
                    waiter.set_result(None)
            else:
                remaining.append(entry)
        self._waiters = remaining

    def __repr__(self) -> str:
        if self._exception is not None:
            state = f"failed: {self._exception!r}"
        elif self._done:
            state = "done"
        else:
            state = f"{self._landed}/{self._num_layers} layers landed"
        return f"<LayerwiseCopy pages={self._num_pages} layers={self._num_layers} {state}>"
