"""How a signal ends a storage or manifest command.

SIGTERM (what `timeout`, systemd and kubectl send) ends it as Ctrl-C (SIGINT) does: the work
is cancelled, the store closed (its lock released, its temporary files removed), one line is
printed and the exit status is 128 + the signal number. The first signal is the one that
counts: later ones are ignored while the command cleans up, so that the clean-up runs to its
end without a traceback.

`main()` is also a function a host process may call (a test harness, a server's admin hook):
only a signal whose disposition is still the interpreter's default is taken over (SIGINT:
`signal.default_int_handler`, SIGTERM: `SIG_DFL`). One the parent set to be ignored (a
background job of a non-interactive shell ignores SIGINT) stays ignored, and a handler of the
host's own is left in place. Whatever was set on entry is set again when the command returns,
interrupted or not.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

__all__ = [
    "ignore_at_exit",
    "ignore_while_ending",
    "install_inside",
    "received",
    "reset",
    "signals_interrupt",
]

_SIGNALS = (signal.SIGINT, signal.SIGTERM)
#: The first signal that ended the command, if one did.
_received: list[int] = []
#: The signals the running command has taken over (their disposition on entry was the
#: interpreter's default); empty outside `signals_interrupt()`.
_owned: list[int] = []


def received() -> int | None:
    """The signal that interrupted the command, or None (a KeyboardInterrupt raised some
    other way counts as SIGINT)."""
    return _received[0] if _received else None


def reset() -> None:
    """Forget the signal a previous command received: each call of `main()` starts afresh."""
    _received.clear()


def _in_main_thread() -> bool:
    # Handlers can only be set from the main thread; main() run from a worker thread (a
    # test) keeps the process's handlers.
    return threading.current_thread() is threading.main_thread()


def _is_default(number: int, disposition: object) -> bool:
    if number == signal.SIGINT:
        return disposition is signal.default_int_handler
    return disposition == signal.SIG_DFL


def ignore_at_exit() -> None:
    """Ignore SIGINT and SIGTERM from now on, for a process that is about to exit after an
    interrupted command: another Ctrl-C would only cut its exit short (a traceback from the
    threads joined then). Only the `hicache-async` executable and `python -m hicache_async`
    call this, never `main()`, which returns to its caller."""
    if _in_main_thread():
        for number in _SIGNALS:
            signal.signal(number, signal.SIG_IGN)


def ignore_while_ending() -> None:
    """Ignore the signals the command took over while it cleans up after an interrupt,
    until `signals_interrupt()` sets the dispositions it saved again on leaving."""
    if _in_main_thread():
        for number in _owned:
            signal.signal(number, signal.SIG_IGN)


@contextlib.contextmanager
def signals_interrupt() -> Iterator[None]:
    """While the block runs, the first SIGTERM, where its disposition is SIG_DFL, interrupts
    the command as Ctrl-C does, and later signals are ignored. The coroutine the command
    runs under `asyncio.run` calls `install_inside()` first. The dispositions found on entry
    are set again on leaving, whatever happened in the block."""
    _received.clear()
    if not _in_main_thread():
        yield
        return
    saved = {number: signal.getsignal(number) for number in _SIGNALS}
    _owned[:] = [
        number for number, disposition in saved.items() if _is_default(number, disposition)
    ]
    # SIGINT keeps Python's handler here: `asyncio.run` installs its own only in place of it.
    if signal.SIGTERM in _owned:
        signal.signal(signal.SIGTERM, _first_only(None))
    try:
        yield
    finally:
        _owned.clear()
        for number, previous in saved.items():
            if previous is not None:  # None: set outside Python, cannot be set back
                signal.signal(number, previous)


def install_inside() -> None:
    """Route SIGINT and SIGTERM, those the command took over, to the SIGINT handler
    `asyncio.run` installed (Python 3.11+: it cancels the main task, which closes the store,
    then raises KeyboardInterrupt), the first only; called from the coroutine it runs, inside
    `signals_interrupt()`. Where SIGINT is the host's or ignored, `asyncio.run` installed
    nothing, and SIGTERM raises KeyboardInterrupt."""
    if not _in_main_thread() or not _owned:
        return
    inner: _Handler | None = None
    if signal.SIGINT in _owned:
        current = signal.getsignal(signal.SIGINT)
        inner = current if callable(current) else None
    handler = _first_only(inner)
    for number in _owned:
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
