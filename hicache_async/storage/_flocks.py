"""Descriptors that hold (or are about to take) a flock, closed in every forked child.

A flock belongs to the open file description, which a forked child shares: while the child's
copy of the descriptor exists, the parent's close releases nothing, so a long-lived child
(a multiprocessing worker, say) would keep the lock for its whole life. O_CLOEXEC only helps
across exec. Each such descriptor is registered here from its open to its close, and a fork
hook closes the registered ones in the child.

Registration and close are atomic with respect to fork: the hook holds the mutex across the
fork, so a child sees each descriptor either registered or closed. A descriptor opened while
a fork went on (which the child may share, unregistered) is reopened: the parent's flock of
it would be the child's too.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable

__all__ = ["close_lock_fd", "open_lock_fd"]


class _Registry:
    """The descriptors registered, and the forks seen, under one mutex."""

    def __init__(self) -> None:
        # Reentrant: a signal handler that forks while its thread holds it must not deadlock.
        self.mutex = threading.RLock()
        self.held: set[int] = set()
        self.forks = 0  # forks of this process, counted in the parent


_REGISTRY = _Registry()


def open_lock_fd(opener: Callable[[], int]) -> int:
    """The descriptor `opener()` opens, registered to be closed in forked children; close it
    with `close_lock_fd`. `opener` may block (it runs outside the mutex) and raise."""
    while True:
        seen = _REGISTRY.forks
        fd = opener()
        with _REGISTRY.mutex:
            if _REGISTRY.forks == seen:
                _REGISTRY.held.add(fd)
                return fd
        # A child forked during the open may share this open file: not one to flock.
        os.close(fd)


def close_lock_fd(fd: int) -> None:
    """Close a descriptor from `open_lock_fd` (releasing its flock) and unregister it, in one
    step as far as fork is concerned. Raises OSError as `os.close` does (unregistered even
    then: the descriptor is gone either way).

    One no longer registered is left alone: in a forked child the hook closed it, and its
    number may since belong to another file of the child's."""
    with _REGISTRY.mutex:
        if fd in _REGISTRY.held:
            _REGISTRY.held.discard(fd)
            os.close(fd)


def _before_fork() -> None:
    _REGISTRY.mutex.acquire()


def _after_fork_in_parent() -> None:
    _REGISTRY.forks += 1
    _REGISTRY.mutex.release()


def _after_fork_in_child() -> None:
    # Taken out first: a collection here may run a store's finalizer, whose `close_lock_fd`
    # (the mutex is reentrant) would change the set under the loop. It finds its descriptor
    # unregistered and leaves it to this loop.
    held, _REGISTRY.held = _REGISTRY.held, set()
    try:
        for fd in held:
            with contextlib.suppress(OSError):
                os.close(fd)
    finally:
        _REGISTRY.mutex.release()


os.register_at_fork(
    before=_before_fork,
    after_in_parent=_after_fork_in_parent,
    after_in_child=_after_fork_in_child,
)
