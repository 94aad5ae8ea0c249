"""How a signal ends a storage or manifest command.

SIGTERM (what `timeout`, systemd and kubectl send) ends it as Ctrl-C (SIGINT) does: the work
is cancelled, the store closed (its lock released, its temporary files removed), one line is
printed and the exit status is 128 + the signal number. The first signal is the one that
counts: later ones are ignored, so that the clean-up runs to its end without a traceback.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

__all__ = ["ignore_more", "install_inside", "received", "signals_interrupt"]

_SIGNALS = (signal.SIGINT, signal.SIGTERM)
#: The first signal that ended the command, if one did.
_received: list[int] = []


def received() -> int | None:
    """The signal that interrupted the command, or None (a KeyboardInterrupt raised some
    other way counts as SIGINT)."""
    return _received[0] if _received else None


def _in_main_thread() -> bool:
    # Handlers can only be set from the main thread; main() run from a worker thread (a
    # test) keeps the process's handlers.
    return threading.current_thread() is threading.main_thread()


def ignore_more() -> None:
    """Ignore SIGINT and SIGTERM from now on: the command is ending, and a second Ctrl-C
    would only cut its clean-up short (a traceback from the threads joined at exit)."""
    if _in_main_thread():
        for number in _SIGNALS:
            signal.signal(number, signal.SIG_IGN)


@contextlib.contextmanager
def signals_interrupt() -> Iterator[None]:
    """While the block runs, the first SIGINT or SIGTERM interrupts the command as Ctrl-C
    does, and later ones are ignored. The coroutine the command runs under `asyncio.run`
    calls `install_inside()` first. The handlers are restored on leaving, unless a signal
    came: the command is ending then (see `ignore_more`)."""
    _received.clear()
    if not _in_main_thread():
        yield
        return
    saved = {number: signal.getsignal(number) for number in _SIGNALS}
    # SIGINT keeps Python's handler here: `asyncio.run` installs its own only in place of it.
    signal.signal(signal.SIGTERM, _first_only(None))
    try:
        yield
    finally:
        if not _received:
            for number, previous in saved.items():
                signal.signal(number, previous)


def install_inside() -> None:
    """Route SIGINT and SIGTERM to the SIGINT handler `asyncio.run` installed (Python 3.11+:
    it cancels the main task, which closes the store, then raises KeyboardInterrupt), the
    first only; called from the coroutine it runs, inside `signals_interrupt()`."""
    if not _in_main_thread():
        return
    current = signal.getsignal(signal.SIGINT)
    handler = _first_only(current if callable(current) else None)
    for number in _SIGNALS:
        signal.signal(number, handler)


_Handler = Callable[[int, FrameType | None], Any]


def _first_only(inner: _Handler | None) -> _Handler:
    """A handler passing the first signal on to `inner` as a SIGINT (None: raise
    KeyboardInterrupt, as Python's own SIGINT handler does) and ignoring the rest."""

    def handle(number: int, frame: FrameType | None) -> None:
        if _received:
            return  # ending already
        _received.append(number)
        if inner is None:
            raise KeyboardInterrupt
        inner(signal.SIGINT, frame)

    return handle
