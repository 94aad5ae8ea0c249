"""One event loop for a run of benchmark steps (the standard library's runner class is 3.11+)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from types import TracebackType
from typing import Any, TypeVar

__all__ = ["LoopRunner", "fastest_loop_factory"]

T = TypeVar("T")


class LoopRunner:
    """A loop made by `loop_factory`, that `run` drives coroutine by coroutine; closed, with
    its async generators and default executor shut down, when the block ends."""

    def __init__(self, loop_factory: Callable[[], asyncio.AbstractEventLoop]) -> None:
        self._loop = loop_factory()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run `coro` to completion on the loop and return its result."""
        return self._loop.run_until_complete(coro)

    def __enter__(self) -> LoopRunner:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        loop = self._loop
        try:
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.run_until_complete(loop.shutdown_default_executor())
        finally:
            loop.close()


def fastest_loop_factory() -> Callable[[], asyncio.AbstractEventLoop]:
    """uvloop's event loop where it is installed, else asyncio's: the storage bench runs the
    store and the baselines' asyncio clients on it alike."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency except on Windows
        return asyncio.new_event_loop
    factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    return factory
