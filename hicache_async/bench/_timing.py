"""Per-call timing shared by the storage bench and its raw baselines, so that every side of an
`exists64_us` record is the same statistic over the same number of calls."""

from __future__ import annotations

import statistics
import time
from collections.abc import Awaitable, Callable

__all__ = ["EXISTS_CALLS", "amedian_us", "median_us"]

#: Calls timed for each side of an `exists64_us` record; the median counts.
EXISTS_CALLS = 500


def median_us(call: Callable[[], object], calls: int) -> float:
    """Median microseconds of `calls` calls of `call`, each timed on its own."""
    if calls < 1:
        raise ValueError(f"calls must be >= 1, got {calls}")
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


async def amedian_us(call: Callable[[], Awaitable[object]], calls: int) -> float:
    """`median_us` of a coroutine function: each call awaited and timed on its own."""
    if calls < 1:
        raise ValueError(f"calls must be >= 1, got {calls}")
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        await call()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6
