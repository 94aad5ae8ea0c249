"""One event loop for a run of benchmark steps (the standard library's runner class is 3.11+)."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable, Coroutine
from types import TracebackType
from typing import Any, TypeVar

from .._extras import install_hint

__all__ = ["UVLOOP_EXTRA", "LoopRunner", "fastest_loop_factory", "uvloop_factory"]

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


#: How a user gets uvloop, named wherever a run goes without it.
UVLOOP_EXTRA = install_hint("bench")

_fallback_said = False


def uvloop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's `new_event_loop`, or None where uvloop is not installed (the `bench` extra)."""
    try:
        import uvloop
    except ImportError:
        return None
    factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    return factory


def say_asyncio_fallback() -> None:
    """Tell, once a process, that the run goes on asyncio's loop for want of uvloop: its
    figures are not comparable with those of a run on uvloop."""
    global _fallback_said  # noqa: PLW0603 - once per process, across benchmarks and runners
    if not _fallback_said:
        _fallback_said = True
        print(
            f"hicache-async bench: uvloop is not installed, running on asyncio's event loop "
            f"({UVLOOP_EXTRA} for uvloop)",
            file=sys.stderr,
            flush=True,
        )


def fastest_loop_factory() -> Callable[[], asyncio.AbstractEventLoop]:
    """uvloop's event loop where it is installed, else asyncio's (said once): the storage
    bench runs the store and the baselines' asyncio clients on it alike."""
    factory = uvloop_factory()
    if factory is None:
        say_asyncio_fallback()
        return asyncio.new_event_loop
    return factory
