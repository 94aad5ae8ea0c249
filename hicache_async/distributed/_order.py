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
        self._idle = asyncio.Event()
        self._idle.set()
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
        """Background sequences begun and not yet ended."""
        return self._active

    @property
    def stop_requested(self) -> bool:
        """A request agreement is waiting: background sequences should agree to stop."""
        return self._stop

    def begin(self) -> None:
        """A background sequence starts (or is scheduled to: count it before its task runs,
        so a request agreement made meanwhile waits for it too)."""
        self._active += 1
        self._idle.clear()
        self._running.add(self)

    def end(self) -> None:
        """A background sequence entered its last collective; pair with `begin`."""
        self._active -= 1
        if self._active == 0:
            # The stop applied to the sequences that were running; later ones start afresh.
            self._stop = False
            self._idle.set()
            self._running.discard(self)

    async def wait_idle(self) -> None:
        """Ask the running background sequences to stop, and return once none is left.

        Returns without yielding when none runs, so the request's collective is entered in
        the same step as its local result was taken.
        """
        while self._active:
            self._stop = True
            await self._idle.wait()
