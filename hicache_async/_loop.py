"""Loop ownership: the tree, the pools and all bookkeeping belong to one event loop's thread."""

from __future__ import annotations

import asyncio
import threading

from ._errors import WrongThreadError
from ._forks import current_pid, forked_error

__all__ = ["LoopOwner"]


class LoopOwner:
    """Remembers the thread (and, once bound, the event loop) that owns an object.

    `check()` is cheap enough to call at the top of every public method: one thread-id
    comparison, plus a loop comparison when a loop is running in this thread.
    """

    __slots__ = ("_loop", "_name", "_pid", "_thread_id")

    def __init__(self, name: str) -> None:
        self._name = name
        self._thread_id = threading.get_ident()
        self._pid = current_pid()
        self._loop: asyncio.AbstractEventLoop | None = None

    def bind(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Bind to `loop` (default: the running loop) and the current thread."""
        self._loop = loop if loop is not None else asyncio.get_running_loop()
        self._thread_id = threading.get_ident()
        self._pid = current_pid()

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        return self._loop

    def on_owner_thread(self) -> bool:
        """Whether the calling thread is the owner's (safe from any thread)."""
        return threading.get_ident() == self._thread_id

    def check(self) -> None:
        """Raise `WrongThreadError` unless called from the owner's thread and loop, in the
        owner's process: a forked child has the forking thread's id, and may even run the
        parent's loop object, but none of the owner's other threads."""
        if current_pid() != self._pid:
            raise WrongThreadError(forked_error(self._name, self._pid))
        if threading.get_ident() != self._thread_id:
            raise WrongThreadError(
                f"{self._name} is owned by thread {self._thread_id} and was called from thread "
                f"{threading.get_ident()}; hand work to its event loop instead "
                "(loop.call_soon_threadsafe or asyncio.run_coroutine_threadsafe)"
            )
        if self._loop is not None:
            try:
                running = asyncio.get_running_loop()
            except RuntimeError:
                return
            if running is not self._loop:
                raise WrongThreadError(
                    f"{self._name} belongs to another event loop; create one per loop"
                )
