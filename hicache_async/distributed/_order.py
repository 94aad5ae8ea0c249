"""Keeping a rank's background agreements (warmup) and request agreements apart.

A warmup runs its agreements from its own task while requests agree from theirs. Two tasks
issuing collectives on one rank interleave them by timing, and timing differs between ranks,
so one rank would pair a warmup agreement with another rank's prefetch agreement. Instead,
with a rank group a request agreement first asks every running warmup to stop and waits until
none is left. The stop itself is agreed (a warmup's per-entry "go on?" is a MIN over ranks), so
every rank's warmup ends after the same entry with the same collectives, and every rank then
enters the request's agreement after them: the same order everywhere, whatever the timing.
"""

from __future__ import annotations

import asyncio
import weakref
from typing import ClassVar

from ._group import RankGroup

__all__ = ["BackgroundAgreements"]


class BackgroundAgreements:
    """The background agreement sequences (warmups) running over one rank group."""

    _of: ClassVar[weakref.WeakKeyDictionary[RankGroup, BackgroundAgreements]] = (
        weakref.WeakKeyDictionary()
    )
    # Groups that cannot be weakly referenced (classes with __slots__ and no __weakref__),
    # by id. The entry lives exactly as long as its instance, which holds the group: the id
    # cannot be reused meanwhile, and one group never has two live instances. Once nobody
    # holds the instance (no sequence runs, nobody waits), both go.
    _of_strong: ClassVar[weakref.WeakValueDictionary[int, BackgroundAgreements]] = (
        weakref.WeakValueDictionary()
    )
    # Instances with sequences running: kept alive (so registered) even if only the count
    # refers to them, so a request agreement always finds the running ones.
    _running: ClassVar[set[BackgroundAgreements]] = set()

    def __init__(self) -> None:
        self._active = 0
        self._stop = False
        # Futures of the request agreements waiting for the count to reach 0, all made on
        # `_loop`: futures rather than an `asyncio.Event`, which would stay bound to the
        # first loop that waited and refuse every later one.
        self._waiters: list[asyncio.Future[None]] = []
        # The loop the count and waiters belong to (see `_bind`).
        self._loop: asyncio.AbstractEventLoop | None = None
        self._group: RankGroup | None = None  # set for groups in `_of_strong` only

    @classmethod
    def of(cls, group: RankGroup) -> BackgroundAgreements:
        """The one instance for `group` (made on first use; while anyone holds it or a
        sequence runs, every call returns the same one)."""
        try:
            found = cls._of.get(group)
        except TypeError:
            found = cls._of_strong.get(id(group))
            if found is None:
                found = cls()
                found._group = group
                cls._of_strong[id(group)] = found
            return found
        if found is None:
            found = cls._of[group] = cls()
        return found

    @property
    def active(self) -> int:
        """Background sequences begun and not yet ended (on a loop still open)."""
        self._bind(_running_loop(), reading=True)
        return self._active

    @property
    def stop_requested(self) -> bool:
        """A request agreement is waiting: background sequences should agree to stop."""
        self._bind(_running_loop(), reading=True)
        return self._stop

    def begin(self) -> None:
        """A background sequence starts (or is scheduled to: count it before its task runs,
        so a request agreement made meanwhile waits for it too)."""
        loop = _running_loop()
        self._bind(loop)
        if loop is not None:
            self._loop = loop
        self._active += 1
        self._running.add(self)

    def end(self) -> None:
        """A background sequence entered its last collective; pair with `begin`.

        An end on another loop than the count's is of a count already dropped (`_bind`),
        and does nothing.
        """
        loop = _running_loop()
        if self._active == 0 or (loop is not None and self._loop not in (None, loop)):
            return
        self._active -= 1
        if self._active == 0:
            # The stop applied to the sequences that were running; later ones start afresh.
            self._stop = False
            self._running.discard(self)
            self._loop = None  # nothing left of that loop's: the next one starts afresh
            waiters, self._waiters = self._waiters, []
            for waiter in waiters:
                if not waiter.done():
                    waiter.set_result(None)

    async def wait_idle(self) -> None:
        """Ask the running background sequences to stop, and return once none is left.

        Returns without yielding when none runs, so the request's collective is entered in
        the same step as its local result was taken.
        """
        loop = asyncio.get_running_loop()
        self._bind(loop)
        while self._active:
            self._loop = loop
            self._stop = True
            waiter: asyncio.Future[None] = loop.create_future()
            self._waiters.append(waiter)
            try:
                await waiter
            finally:
                if waiter in self._waiters:
                    self._waiters.remove(waiter)

    def _bind(self, loop: asyncio.AbstractEventLoop | None, *, reading: bool = False) -> None:
        """Drop the count and waiters of a loop that is no longer running.

        One group object can serve one `asyncio.run` after another (as test harnesses do):
        a sequence counted on a loop closed before it ended never ends its count there, and
        that loop's waiters can never be woken. Sequences and requests of the loop running
        now do not wait for them. Two loops running at once on one group would interleave
        its collectives by timing: refused. `reading` from outside any loop drops only a
        closed loop's count: a loop stopped between `run_until_complete` calls resumes its
        sequences at the next call.
        """
        bound = self._loop
        if bound is None or bound is loop:
            return
        if bound.is_running() and not bound.is_closed():
            if loop is None:
                return  # read from outside any loop: the running one's state stands
            raise RuntimeError(
                "background agreements of one rank group used from two running event loops"
            )
        if reading and loop is None and not bound.is_closed():
            return
        self._loop = None
        self._active = 0
        self._stop = False
        self._waiters = []
        self._running.discard(self)


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None
