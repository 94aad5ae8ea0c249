"""Rate limits for the warnings a storage outage would repeat at every request or batch.

A store that fails every call fails the `exists` of every prefetch and the `put` of every
backup batch: one warning each would be a log flood on a busy host while telling nothing new.
The counters of `statistics()` keep the totals; the log tells each kind of failure at once
and then how often it went on.
"""

from __future__ import annotations

import math
import operator
import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = ["LOG_INTERVAL_S", "LogLimiter", "describe_error"]

#: A repeated warning of one kind is logged at most once per this many seconds.
LOG_INTERVAL_S = 60.0
#: Kinds told apart per limiter: errors whose text changes at every call cannot grow it
#: without bound (past it, new kinds of an event share one).
_MAX_KINDS = 32
#: A kind not logged for this many intervals (an hour) makes room for a new one once the
#: table is full: errors whose text changes at every call then get a line per kind an hour,
#: not one a minute, and a failure long after the table filled is still told at once.
_FORGET_AFTER_INTERVALS = 60


class LogLimiter:
    """Lets the first record of each kind through, then at most one per `interval_s`.

    A kind is an event name and an error text, so a new failure is told at once and a
    repeated one once per interval, with how many records of its kind were left out since
    the last one logged (`unlogged_since_last`).
    """

    __slots__ = ("_clock", "_forget_after_s", "_interval_s", "_kinds", "_lock", "_max_kinds")

    def __init__(
        self,
        interval_s: float = LOG_INTERVAL_S,
        *,
        max_kinds: int = _MAX_KINDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._interval_s = interval_s
        self._forget_after_s = interval_s * _FORGET_AFTER_INTERVALS
        self._max_kinds = max_kinds
        self._clock = clock
        # (event, error) -> (when last logged, records left out since, sum of their amounts)
        self._kinds: dict[tuple[str, str], tuple[float, int, int]] = {}
        self._lock = threading.Lock()  # a file store's job threads log through it too

    def admit(self, event: str, error: str = "") -> int | None:
        """None when this record is to be left out; else how many records of its kind were
        left out since the last one logged."""
        admitted = self.admit_counting(event, error, 0)
        return None if admitted is None else admitted[0]

    def admit_counting(self, event: str, error: str, amount: int) -> tuple[int, int] | None:
        """As `admit`, for a record about `amount` things (pages): None when it is to be left
        out (its amount is kept for the next one logged); else how many records of its kind
        were left out since the last one logged, and the sum of their amounts."""
        kind = (event, error)
        with self._lock:
            now = self._clock()
            if kind not in self._kinds and len(self._kinds) >= self._max_kinds:
                self._forget_quiet(now)
                if len(self._kinds) >= self._max_kinds:
                    kind = (event, "")
            last, unlogged, amounts = self._kinds.get(kind, (-math.inf, 0, 0))
            if now - last < self._interval_s:
                self._kinds[kind] = (last, unlogged + 1, amounts + amount)
                return None
            self._kinds[kind] = (now, 0, 0)
            return unlogged, amounts

    @property
    def interval_s(self) -> float:
        """Seconds between two logged records of one kind."""
        return self._interval_s

    def take_due(self, event: str) -> tuple[list[tuple[str, int]], bool]:
        """The kinds of `event` with records left out since a line at least `interval_s`
        old, as (error, how many), each counting as logged now; and whether other records of
        `event` are left out, not due yet."""
        with self._lock:
            now = self._clock()
            due: list[tuple[str, int]] = []
            waiting = False
            for (name, error), (last, unlogged, _) in list(self._kinds.items()):
                if name != event or not unlogged:
                    continue
                if now - last >= self._interval_s:
                    due.append((error, unlogged))
                    self._kinds[(name, error)] = (now, 0, 0)
                else:
                    waiting = True
            return due, waiting

    def warn(self, logger: Any, event: str, error: str, **fields: object) -> None:
        """Log `event` at warning level with `error` and `unlogged_since_last`, unless
        `admit` leaves it out."""
        unlogged = self.admit(event, error)
        if unlogged is not None:
            logger.warning(event, error=error, unlogged_since_last=unlogged, **fields)

    def warn_tallied(
        self, logger: Any, event: str, error: str, tally: str, **fields: object
    ) -> None:
        """As `warn`, for a record whose integer field `tally` (`pages`) says what it is about:
        the line also has `unlogged_<tally>_since_last`, the sum of that field over the
        records left out, which a count of lines alone would lose."""
        value = fields[tally]
        # A bool passes `operator.index` but is no count; numpy's integers are counts.
        if isinstance(value, bool):
            raise TypeError(f"the tallied field {tally!r} is a bool, not a count: {value!r}")
        try:
            amount = operator.index(value)  # type: ignore[arg-type]
        except TypeError:
            raise TypeError(f"the tallied field {tally!r} is not an integer: {value!r}") from None
        fields[tally] = amount  # a plain int, which every log renderer (JSON) takes
        admitted = self.admit_counting(event, error, amount)
        if admitted is not None:
            fields[f"unlogged_{tally}_since_last"] = admitted[1]
            logger.warning(event, error=error, unlogged_since_last=admitted[0], **fields)

    def _forget_quiet(self, now: float) -> None:
        """Drop the kinds not logged for `_FORGET_AFTER_INTERVALS` intervals: kept for good,
        the kinds of errors long gone would fill the table, and every new failure after them
        would share one kind, left out for a minute behind another. Those with no record left
        out go first; the others only when that frees no room, their left-out records (and
        amounts) then going to their event's shared kind, whose next line tells them."""
        quiet = [
            kind for kind, (last, _, _) in self._kinds.items() if now - last >= self._forget_after_s
        ]
        told = [kind for kind in quiet if not self._kinds[kind][1]]
        for kind in told or quiet:
            event, error = kind
            _, unlogged, amounts = self._kinds[kind]
            if unlogged and not error:
                continue  # a shared kind keeps what it has to tell
            del self._kinds[kind]
            if unlogged:
                shared = (event, "")
                last, shared_unlogged, shared_amounts = self._kinds.get(shared, (-math.inf, 0, 0))
                self._kinds[shared] = (last, shared_unlogged + unlogged, shared_amounts + amounts)


def describe_error(exc: BaseException, timeout_s: float) -> str:
    """`repr(exc)`, or for the TimeoutError of a call that ran past `timeout_s` (which has
    no text) how long it was given."""
    if isinstance(exc, TimeoutError) and not str(exc):
        return f"TimeoutError: no answer within {timeout_s:g} s"
    return repr(exc)
