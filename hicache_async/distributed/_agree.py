"""Agreement helpers that keep every rank's collective count equal whatever fails locally.

A rank that skips a collective because its local step raised leaves its peers waiting in that
collective until they time out (SGLang's warmup deadlocked this way when manifests differed).
So each helper runs the local step, turns any failure into the neutral contribution, and then
enters its collective exactly once, on every path.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence

import structlog

from ._group import RankGroup, check_int64, unique_items

__all__ = ["agree_entries", "agree_min"]

_log = structlog.get_logger("hicache_async")


async def agree_min(group: RankGroup, local: Callable[[], Awaitable[int]]) -> int:
    """The minimum over ranks of each rank's `local()`, e.g. how many pages a prefetch hit.

    If `local()` raises or returns something that is not a signed 64-bit int, this rank
    contributes 0 (so the agreement is 0) and logs ``tp.local.failed``. If it is cancelled,
    this rank still enters the collective with 0, waits for it, and then re-raises the
    cancellation, so its peers are not left waiting. Either way `group.all_min` is entered
    exactly once. Errors of the collective itself (`CollectiveError`) propagate.
    """
    try:
        value = check_int64(await local())
    except asyncio.CancelledError:
        await _enter_then_reraise(group.all_min(0))
        raise
    except Exception as exc:
        _log_failure(group, "agree_min", exc)
        value = 0
    return await group.all_min(value)


async def agree_entries(
    group: RankGroup, local: Callable[[], Awaitable[Sequence[bytes]]]
) -> list[bytes]:
    """The entries every rank's `local()` returned, in rank 0's order, e.g. which warmup
    manifest entries to load.

    If `local()` raises or returns something other than a sequence of bytes, this rank
    contributes the empty set (so the agreement is empty) and logs ``tp.local.failed``.
    Cancellation, and errors of the collective itself, are handled as in `agree_min`.
    `group.agree_common` is entered exactly once on every path.
    """
    try:
        items = unique_items(await local())
    except asyncio.CancelledError:
        await _enter_then_reraise(group.agree_common(()))
        raise
    except Exception as exc:
        _log_failure(group, "agree_entries", exc)
        items = []
    return await group.agree_common(items)


async def _enter_then_reraise(collective: Awaitable[object]) -> None:
    """Await `collective` for its side effect on the peers; swallow what it raises, because
    the caller is about to re-raise its own cancellation."""
    try:
        await collective
    except (asyncio.CancelledError, Exception):
        # Cancelled again while waiting: the collective was already entered and completes on
        # its own; a collective error: the peers see it too. Either way the cancellation wins.
        return


def _log_failure(group: RankGroup, helper: str, exc: Exception) -> None:
    _log.warning(
        "tp.local.failed",
        helper=helper,
        rank=group.rank,
        size=group.size,
        error=f"{type(exc).__name__}: {exc}",
    )
